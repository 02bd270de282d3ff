//! Fuzz the admission queues with arbitrary operation sequences (submit, pop, pop_wait,
//! complete, abandon, drop a ticket, close) under every policy, checking every step against the
//! sequential model shared with tests/admission_model.rs: depths, loads, in-flight count, drop
//! counters, health, and each ticket's outcome, then the teardown. The `Debug` of `Input` is a
//! reproducer: paste it into a test calling `model::run`.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;

#[path = "../../tests/support/admission_model.rs"]
mod model;

#[derive(Debug, Arbitrary)]
struct Input {
    workers: u8,
    high_capacity: u8,
    low_capacity: u8,
    policy: u8,
    ops: Vec<FuzzOp>,
}

#[derive(Debug, Arbitrary)]
enum FuzzOp {
    Submit { route: u16, high: bool, wait: bool },
    Pop { worker: u8 },
    PopWait { worker: u8 },
    Complete { idx: u8 },
    Abandon { idx: u8 },
    DropTicket { idx: u8 },
    Close,
}

fuzz_target!(|input: Input| {
    if input.ops.len() > 512 {
        return;
    }
    let ops: Vec<model::Op> = input
        .ops
        .iter()
        .map(|op| match *op {
            FuzzOp::Submit { route, high, wait } => model::Op::Submit { route, high, wait },
            FuzzOp::Pop { worker } => model::Op::Pop { worker },
            FuzzOp::PopWait { worker } => model::Op::PopWait { worker },
            FuzzOp::Complete { idx } => model::Op::Complete { idx },
            FuzzOp::Abandon { idx } => model::Op::Abandon { idx },
            FuzzOp::DropTicket { idx } => model::Op::DropTicket { idx },
            FuzzOp::Close => model::Op::Close,
        })
        .collect();
    model::run(
        model::Params {
            workers: input.workers,
            high_capacity: input.high_capacity,
            low_capacity: input.low_capacity,
            policy: input.policy,
        },
        &ops,
    );
});
