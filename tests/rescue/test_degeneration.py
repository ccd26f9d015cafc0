"""The online degeneration detector (KV-Rescue): loops and garbage are aborted, reasoning is not."""

import math

import numpy as np
import pytest

from zoomr.rescue.degeneration import DegenerationDetector, DetectorConfig, entropy_nats, gzip_ratio

VOCAB = 49152  # the embedded model's vocabulary

REASONING = (
    "Janet's ducks lay 16 eggs per day. She eats 3 of them for breakfast, so 16 - 3 = 13 eggs are left.\n\n"
    "She bakes muffins for her friends every day with 4 eggs, which leaves 13 - 4 = 9 eggs.\n\n"
    "She sells each of the remaining eggs at the farmers' market for $2, so she makes 9 * 2 = $18 every day.\n\n"
    "To double-check: 3 + 4 = 7 eggs are used at home, and 16 - 7 = 9 eggs are sold. Nine eggs at two dollars "
    "apiece is eighteen dollars, which matches the first computation.\n\n"
    "A robe takes 2 bolts of blue fiber and half that much white fiber, which is 2 / 2 = 1 bolt. Together the "
    "robe needs 2 + 1 = 3 bolts. Josh buys a house for $80,000 and puts in $50,000 of repairs, for a total "
    "cost of $130,000. The repairs raise the value by 150%, so the house is worth 80,000 * 2.5 = $200,000, "
    "and his profit is 200,000 - 130,000 = $70,000.\n\nTherefore, the final answer is \\boxed{18}."
)


def peaked_logits(rng, top=20.0) -> np.ndarray:
    """A confident next-token distribution: one token far above a flat rest (entropy well under 1 nat)."""
    z = rng.normal(0.0, 1.0, VOCAB).astype(np.float32)
    z[rng.integers(VOCAB)] += top
    return z


def feed(detector, pieces, logits_fn):
    """Push pieces one by one; return (signals, index of the abort or None)."""
    for i, piece in enumerate(pieces):
        s = detector.push(piece, logits_fn())
        if s.abort:
            return s, i
    return detector.signals, None


def test_entropy_and_gzip_primitives():
    assert entropy_nats(np.zeros(VOCAB, np.float32)) == pytest.approx(math.log(VOCAB), rel=1e-9)
    onehot = np.full(VOCAB, -1e4, np.float32)
    onehot[7] = 0.0
    assert entropy_nats(onehot) < 1e-6
    p = np.array([0.5, 0.25, 0.25])
    assert entropy_nats(np.log(p).astype(np.float32)) == pytest.approx(-(p * np.log(p)).sum(), rel=1e-6)
    assert gzip_ratio("") == 1.0
    assert gzip_ratio("ab" * 400) < 0.05 < 0.3 < gzip_ratio(REASONING[:800])


def test_repetition_loop_is_aborted_by_gzip_with_confident_tokens():
    rng = np.random.default_rng(0)
    loop = ["So", " the", " answer", " is", " 12", "."] * 60       # a phrase repeated until the limit
    sig, at = feed(DegenerationDetector(), loop, lambda: peaked_logits(rng))
    assert at is not None and sig.abort == "repetition"
    assert sig.min_gzip_ratio < 0.18 and sig.mean_entropy < 1.0    # low entropy: the entropy test alone misses it
    assert at < 120  # caught long before the step-token limit


def test_high_entropy_garbage_is_aborted_right_after_the_guard():
    rng = np.random.default_rng(1)
    symbols = list("#@!$%^&*(){}[]<>?~`|;:ёжщ漢字ℵ∂∇")
    garbage = ["".join(rng.choice(symbols, 3)) for _ in range(60)]
    flat = lambda: rng.normal(0.0, 0.3, VOCAB).astype(np.float32)  # near-uniform: entropy ≈ ln V ≈ 10.8
    sig, at = feed(DegenerationDetector(), garbage, flat)
    assert sig.abort == "entropy" and at == 23   # the 24th token: the guard is 24 tokens
    assert sig.mean_entropy > 10.0
    # the threshold is an option: above ln V nothing is aborted
    sig, at = feed(DegenerationDetector(DetectorConfig(max_entropy=11.0)), garbage, flat)
    assert at is None


def test_normal_reasoning_with_real_model_logits_is_not_aborted(torch_backend):
    """Teacher-forced through the embedded model: each token's distribution is the real one it would be
    sampled from; the text is longer than the 800-character gzip window."""
    tok = torch_backend.tokenizer
    ids = tok.encode(REASONING)
    seq = torch_backend.new_sequence()
    logits = torch_backend.prefill(seq, ids, all_logits=True)         # [T, vocab]
    torch_backend.free(seq)
    det = DegenerationDetector()
    pieces = [tok.decode(ids[:i + 1])[len(tok.decode(ids[:i])):] for i in range(1, len(ids))]
    for i, piece in enumerate(pieces):
        s = det.push(piece, logits[i])   # logits[i] predicts ids[i + 1]
        assert s.abort is None, (i, s)
    assert len(REASONING) > 800 and 0.3 < s.min_gzip_ratio and s.mean_entropy < 7.0


@pytest.mark.parametrize("kw,needle", [({"entropy_window": 0}, "--entropy-window"), ({"gzip_window": 0}, "--gzip-window"),
                                       ({"max_entropy": float("nan")}, "--abort-entropy"),
                                       ({"min_gzip_ratio": -1.0}, "--abort-gzip"), ({"entropy_guard": -1}, "--entropy-guard")])
def test_bad_thresholds_are_one_line_value_errors(kw, needle):
    with pytest.raises(ValueError, match=needle):
        DetectorConfig(**kw).validate()
