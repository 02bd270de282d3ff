//! The seeded workload's conversations: a conversation resends its own history, and nothing
//! else of its session's earlier conversations.

use pagedkv_sim::{self as sim, SimConfig};
use std::collections::HashMap;

/// A conversation that starts over (a request of turn 0) is a new one: its first message is
/// new text, so its prompt shares only the system prompt with the prompts before it. Message
/// tokens were keyed by session and turn alone, so a new conversation of a session repeated
/// its earlier conversations' messages token for token: the prefix cache hit text no user had
/// sent before, and the hit rate and time to first token the README quotes were inflated.
#[test]
fn a_new_conversation_does_not_repeat_an_earlier_ones_messages() {
    let cfg = SimConfig::default();
    let requests = sim::generate(&cfg);
    // The first two message tokens of every earlier prompt, per engine.
    let mut seen: HashMap<(usize, [u32; 2]), u64> = HashMap::new();
    let (mut new, mut repeated) = (0, Vec::new());
    for r in &requests {
        let prompt = r.prompt();
        let sys = r.system_len as usize;
        if prompt.len() < sys + 2 {
            continue;
        }
        let head = [prompt[sys], prompt[sys + 1]];
        if r.turn == 0 {
            new += 1;
            if let Some(&earlier) = seen.get(&(r.engine, head)) {
                repeated.push((r.id, earlier));
            }
        }
        seen.entry((r.engine, head)).or_insert(r.id);
    }
    assert!(new > 50, "{new} new conversations");
    assert!(
        repeated.is_empty(),
        "{} of {new} new conversations start with an earlier request's message \
         (request, earlier request): {:?}",
        repeated.len(),
        &repeated[..repeated.len().min(8)]
    );
}
