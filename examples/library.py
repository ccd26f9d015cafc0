"""zoomr from Python: solve under a KV policy, run KV-Rescue with an event callback, drive a policy on tensors.

Runs from any folder on the embedded model (SmolLM2-135M-Instruct), on CPU in well under a minute:

    python examples/library.py
"""

import torch

import zoomr

PROBLEM, GOLD = "Compute 7 + 8.", "15"


def solve_with_a_policy(model) -> None:
    """(a) Stream a solution under the model's KV policy, then read the answer and the KV accounting."""
    print(f"== solve · {model.describe()}")
    result = zoomr.solve(model, PROBLEM, n_predict=64, on_token=lambda text: print(text, end="", flush=True))
    kv = result.kv
    print(f"\nanswer: {result.answer} (gold {GOLD}: {'correct' if zoomr.grade(GOLD, result.answer) else 'wrong'}) · "
          f"stop: {result.stop_reason} · {len(result.token_ids)} tokens")
    print(f"kv: {kv.mean_active_tokens:.0f} positions attended per decode step (peak {kv.peak_active_tokens}) "
          f"of {kv.full_tokens} written · saving {kv.saving:.2f}×")


def rescue_with_events(base) -> None:
    """(b) KV-Rescue: the evicting model as base, its own weights with full KV as helper, two short steps.

    The detector is set strict (abort above 1 nat of mean entropy over 4 tokens) so that aborts show up."""
    config = zoomr.RescueConfig(nb=2, nh=1, step_tokens=10, max_steps=2,
                                detector=zoomr.DetectorConfig(max_entropy=1.0, entropy_window=4, entropy_guard=4))

    def on_event(event) -> None:
        if event.kind == "candidate_started":
            print(f"step {event.step} · candidate {event.cand} ({event.source}) started")
        elif event.kind == "candidate_aborted":
            print(f"step {event.step} · candidate {event.cand} aborted after {event.tokens} tokens: {event.reason}")
        elif event.kind == "step_committed":
            print(f"step {event.step} · committed candidate {event.cand} ({event.source}, score {event.score:.2f}): "
                  f"{event.text!r}")

    print("== KV-Rescue")
    summary = zoomr.run_rescue(base, PROBLEM, config=config, on_event=on_event).summary()
    print(f"rescue: {len(summary['steps'])} steps, helper share {summary['helper_share']:.0%}, "
          f"{summary['aborted']} aborted · stop: {summary['stop_reason']}")


def drive_a_policy() -> None:
    """(c) H2O with B = 8 on random tensors: a 12-token prefill, then 3 decode steps, one layer."""
    n_layers, n_heads, n_kv_heads, head_dim = 1, 4, 2, 16
    policy = zoomr.make_policy("h2o", budget=8)
    cache = zoomr.PolicyKVCache(policy, n_layers, n_heads, n_kv_heads, head_dim, torch.device("cpu"), torch.float32)
    print(f"== {policy.describe()} on random tensors")
    g = torch.Generator().manual_seed(0)
    for T in (12, 1, 1, 1):
        q = torch.randn(n_heads, T, head_dim, generator=g)          # [H, T, d] post-RoPE queries
        k = torch.randn(n_kv_heads, T, head_dim, generator=g)       # [Hkv, T, d] keys
        v = torch.randn(n_kv_heads, T, head_dim, generator=g)       # [Hkv, T, d] values
        keys, _ = cache.update(0, q, k, v)                          # what attention reads: [Hkv, N, d]
        cache.end_forward(list(range(T)), "")                       # the policy picks what the next forward keeps
        start = cache.n_tokens - T
        print(f"forward at positions {start}..{cache.n_tokens - 1}: attended {keys.shape[1]} per KV head")
        for head, kept in enumerate(cache.positions(0).tolist()):
            print(f"  kv head {head}: {kept}")
    print(f"kv: {cache.stats().active_tokens} of {cache.n_tokens} positions attended at the last forward")


if __name__ == "__main__":
    model = zoomr.load(policy="h2o", budget=32)  # the embedded model; H2O keeps 32 KV positions per head
    solve_with_a_policy(model)
    rescue_with_events(model)
    drive_a_policy()
