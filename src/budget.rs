//! Wait-free global budget coordinator: weighted token and KV-block shares across the models on one device.
