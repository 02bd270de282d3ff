//! sched::admission against a sequential model, one random operation sequence at a time
//! (the same oracle as the `admission_ops` fuzz target).

#[path = "support/admission_model.rs"]
mod model;

use model::{Op, Params};
use proptest::prelude::*;

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (any::<u16>(), any::<bool>(), any::<bool>())
            .prop_map(|(route, high, wait)| Op::Submit { route, high, wait }),
        4 => any::<u8>().prop_map(|worker| Op::Pop { worker }),
        1 => any::<u8>().prop_map(|worker| Op::PopWait { worker }),
        3 => any::<u8>().prop_map(|idx| Op::Complete { idx }),
        1 => any::<u8>().prop_map(|idx| Op::Abandon { idx }),
        1 => any::<u8>().prop_map(|idx| Op::DropTicket { idx }),
        1 => Just(Op::Close).prop_filter("rare", |_| true),
    ]
}

fn params() -> impl Strategy<Value = Params> {
    (any::<u8>(), any::<u8>(), any::<u8>(), any::<u8>()).prop_map(
        |(workers, high_capacity, low_capacity, policy)| Params {
            workers,
            high_capacity,
            low_capacity,
            policy,
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn matches_sequential_model(p in params(), ops in proptest::collection::vec(op(), 0..200)) {
        model::run(p, &ops);
    }
}

/// A fixed sequence that reaches every policy's overflow branch and close.
#[test]
fn overflow_then_close_each_policy() {
    for policy in 0..3 {
        let mut ops = Vec::new();
        for i in 0..12u16 {
            ops.push(Op::Submit {
                route: i * 4,
                high: i % 3 == 0,
                wait: i % 2 == 0,
            });
        }
        ops.extend([
            Op::Pop { worker: 0 },
            Op::Pop { worker: 0 },
            Op::Complete { idx: 0 },
        ]);
        ops.extend([Op::Abandon { idx: 0 }, Op::DropTicket { idx: 1 }, Op::Close]);
        ops.extend([
            Op::Submit {
                route: 2,
                high: false,
                wait: false,
            },
            Op::PopWait { worker: 0 },
        ]);
        model::run(
            Params {
                workers: 0,
                high_capacity: 2,
                low_capacity: 3,
                policy,
            },
            &ops,
        );
    }
}
