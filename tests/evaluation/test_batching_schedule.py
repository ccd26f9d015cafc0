"""bench -np N's continuous batching on the embedded model: which job joins next. Reference runs (full KV's,
whose logits the fidelity passes wait on) go first while fewer than N are alive, so the passes are ready a
round earlier and the batch stays full; the references alive never exceed N."""

import pytest

from zoomr.backends.sampling import SamplingParams
from zoomr.evaluation.batching import FidelityJob, GenerationJob, run_batched
from zoomr.evaluation.cells import problem_prompt
from zoomr.evaluation.datasets import load_problems
from zoomr.kvstore.registry import PolicyCacheFactory, PolicySpec

N_PREDICT = 6


def _jobs(base, problems):
    """Problem-major, as bench lists them: full KV's run, then R-KV's generation and its fidelity pass."""
    rkv = base.with_cache_factory(PolicyCacheFactory(PolicySpec("rkv", 16)))
    greedy = SamplingParams(temperature=0.0)
    jobs = []
    for p in problems:
        ids = problem_prompt(base.tokenizer, p, base.n_ctx)
        full = GenerationJob(base, p, ids, greedy, N_PREDICT, keep_logits=True, ignore_eos=True)
        jobs += [full, GenerationJob(rkv, p, ids, greedy, N_PREDICT, ignore_eos=True), FidelityJob(rkv, ids, full)]
    return jobs


def _run(base, problems, n_parallel):
    """Decode forwards, the most reference runs alive at once, and each job's outcome."""
    jobs = _jobs(base, problems)
    refs = [j for j in jobs if isinstance(j, GenerationJob) and j.keep_logits]
    forwards, alive_max = 0, 0
    decode = base.decode_batch

    def counting(seqs, tokens, on_device=False):
        nonlocal forwards, alive_max
        forwards += 1
        alive_max = max(alive_max, sum(hasattr(j, "seq") and (not j.done or j.reference is not None) for j in refs))
        return decode(seqs, tokens, on_device=on_device)

    base.decode_batch = counting
    try:
        run_batched(base, jobs, n_parallel)
    finally:
        del base.decode_batch
    outcome = [j.record["tokens_generated"] if isinstance(j, GenerationJob) else j.result for j in jobs]
    return forwards, alive_max, outcome


@pytest.mark.slow
def test_reference_runs_first_keep_the_batch_full(torch_backend):
    _, problems = load_problems("gsm8k", 4)
    forwards, alive_max, outcome = _run(torch_backend, problems, 4)
    # 12 jobs of 6 or 7 forwards each in batches of 4: three full rounds, 19 decode forwards (list order took
    # four rounds, 23: the last two 3/4 and 1/4 full, their passes waiting on references started late)
    assert forwards <= 3 * (N_PREDICT + 1), forwards
    assert alive_max <= 4
    _, _, alone = _run(torch_backend, problems, 1)
    assert outcome == alone   # what each job measured does not depend on when it ran
