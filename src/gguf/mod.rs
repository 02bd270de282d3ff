//! GGUF weights: a defensive parser, zero-copy tensor views, dequantization, a writer and device upload.
