"""The summarizer runs a real zoomr model: paragraphs summarized together equal each summarized alone."""

import pytest

from zoomr.errors import UserError
from zoomr.finetune.summarizer import Summarizer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def test_batched_summaries_are_each_paragraphs_own(torch_backend):
    s = Summarizer(max_tokens=6, backend=torch_backend)  # fp32: batches are token-identical to single runs
    paras = ["Sam buys 6 * 7 = 42 eggs.\nHe breaks 5, so 42 - 5 = 37 are left.", "Mia reads 15 pages a day."]
    together = s(paras)
    assert together == [s([p])[0] for p in paras]
    assert all(0 < len(torch_backend.tokenizer.encode(t)) <= 6 and "\n" not in t for t in together)
    assert s(["word " * 3000]) == [""]  # longer than the context: left to the extractive fallback


def test_a_summarizer_that_cannot_load_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="--summarizer"):
        Summarizer(str(tmp_path / "missing.gguf"))
