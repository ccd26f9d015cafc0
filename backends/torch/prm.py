"""A process reward model (PRM) of the Qwen2.5-Math-PRM architecture on our torch decoder.

Architecture (Qwen2.5-Math-PRM-7B, HF ``Qwen2ForProcessRewardModel``): the Qwen2 decoder body
(``model.*`` tensors, no ``lm_head``) followed by a score head on the final-norm hidden states,
Linear(H, H) → ReLU → Linear(H, 2) (tensors ``score.0.*`` and ``score.2.*``).

Input format (the model card's usage, summarized in the KV-Rescue reference): a chat with the system
message "Please reason step by step, and put your final answer within \\boxed{}.", the question as
the user turn, and as the assistant turn the reasoning steps, each followed by the step tag
``<extra_0>``. The reward of a step is softmax(head(h))[1] — P(the step is correct) — at that
step's tag. KV-Rescue (arXiv:2608.15797, "Implementation details") scores a candidate by the
reward of its last step, given the question and the committed steps.

Cost: the committed prefix is the same for every candidate of a step, so its KV is computed once
and forked per candidate (the "shared prefix" the paper batches); only the candidate's tokens run.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from zoomr.backends.chat_prompt import ChatPrompt, Markup, chat_prompt
from zoomr.backends.models import ModelSource
from zoomr.backends.tokenizer import HFTokenizer
from zoomr.kvstore.base import FullKVCache

from .config import ModelConfig
from .engine import pick_device, pick_dtype
from .model import Decoder
from .weights import ModelLoadError, _check_complete, read_hf_dir

STEP_TAG = "<extra_0>"
PRM_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
HEAD = ("score.0.weight", "score.0.bias", "score.2.weight", "score.2.bias")
_CUT = "\x00zoomr-prm-cut\x00"  # marks where the assistant text ends inside the rendered chat


def load_prm_dir(source: ModelSource) -> tuple[ModelConfig, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Config, body tensors and score-head tensors of a PRM directory (``config.json`` + safetensors).

    Returns:
        (config, float32 body tensors under HF names, float32 head tensors under ``score.*`` names).
    Raises:
        ModelLoadError: not a HF directory, no/corrupt weights, unsupported body architecture, no
            score head or a head of the wrong shape.
    """
    if source.kind != "hf":
        raise ModelLoadError(f"{source.path}: a PRM must be a HF model directory or hub id (got a GGUF file)")
    path = source.path
    cfg, tensors = read_hf_dir(path)
    missing = [n for n in HEAD if n not in tensors]
    if missing:
        raise ModelLoadError(f"{path}: not a process reward model (no {missing[0]}: expected the score head "
                             "Linear(H,H) → ReLU → Linear(H,2) as score.0.* / score.2.*)")
    head = {n: tensors.pop(n) for n in HEAD}
    H = cfg.hidden
    if head["score.0.weight"].shape != (H, H) or head["score.2.weight"].shape != (2, H):
        raise ModelLoadError(f"{path}: score head shapes {head['score.0.weight'].shape}, "
                             f"{head['score.2.weight'].shape} do not match hidden size {H} (expected [H,H], [2,H])")
    # the PRM has no LM head: the body is checked (and later built) as if tied, and logits are never asked for
    cfg = dataclasses.replace(cfg, tied_embeddings=True)
    _check_complete(cfg, tensors, str(path))
    return cfg, tensors, head


class ProcessRewardModel:
    """Qwen2.5-Math-PRM-style step rewards.

    Args:
        source: HF directory (a hub id resolved by :func:`zoomr.backends.models.resolve_model`).
        device, dtype: as for :class:`zoomr.backends.torch.engine.TorchBackend` (``auto``: CUDA if present, bf16).
    Raises:
        ModelLoadError: see :func:`load_prm_dir`; also a tokenizer without a single-token ``<extra_0>``.
        ValueError: bad device or dtype.

    Attributes:
        kv_token_bytes: K and V bytes of one position over all layers (bytes).
        last_scored_tokens: tokens of the conversation the last :meth:`last_step_reward` ran over, i.e.
            the positions its KV held then (tokens; 0 before the first call).
    """

    def __init__(self, source: ModelSource, device: str = "auto", dtype: str = "auto"):
        cfg, tensors, head = load_prm_dir(source)
        self.source = source
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        try:
            self.tokenizer = HFTokenizer(source.path)
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
        tag = self.tokenizer.encode(STEP_TAG)
        if len(tag) != 1:
            raise ModelLoadError(f"{source.path}: the tokenizer does not know the step tag {STEP_TAG} as one token")
        self.tag_id = tag[0]
        self.cfg = cfg
        self.model = Decoder(cfg, tensors, self.device, self.dtype)
        del tensors
        # the head is tiny (H×H + 2×H): keep it in float32 so the reward is not rounded to bf16
        self.head = {n: torch.from_numpy(w).to(self.device, torch.float32) for n, w in head.items()}
        self._prefix_ids: list[int] | None = None
        self._prefix_cache: FullKVCache | None = None
        # for memory accounting (KV-Rescue counts the PRM's KV): bytes per position, and the length of
        # the conversation the last :meth:`last_step_reward` scored (tokens)
        self.kv_token_bytes = FullKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, self.device, self.model.kv_dtype,
                                          capacity=1).token_bytes()
        self.last_scored_tokens = 0

    def describe(self) -> str:
        """One line: model, device, dtype."""
        return f"PRM {self.source.name} · torch · {self.device.type} · {str(self.dtype).replace('torch.', '')}"

    def conversation(self, question: str, steps: list[str]) -> ChatPrompt:
        """The PRM's input up to and including the last step's tag (the template's closing tokens come later
        and cannot change the states before them: the model is causal). With no steps: up to the start of
        the assistant's text. The question and steps stay text; only the template and the step tags give
        control tokens."""
        content: list = []
        for s in steps:
            content += [s.replace(STEP_TAG, "").strip(), Markup(STEP_TAG)]
        msgs = [{"role": "system", "content": PRM_SYSTEM}, {"role": "user", "content": question},
                {"role": "assistant", "content": content + [Markup(_CUT)]}]
        return chat_prompt(self.tokenizer, msgs, add_generation_prompt=False).cut(_CUT)

    def conversation_text(self, question: str, steps: list[str]) -> str:
        """The text of :meth:`conversation`."""
        return self.conversation(question, steps).text

    def rewards_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Score head: [N, H] final-norm hidden states → [N] P(positive), float32."""
        h = torch.relu(hidden.float() @ self.head["score.0.weight"].T + self.head["score.0.bias"])
        logits = h @ self.head["score.2.weight"].T + self.head["score.2.bias"]
        return logits.softmax(dim=-1)[:, 1]

    def _new_cache(self) -> FullKVCache:
        c = self.cfg
        return FullKVCache(c.n_layers, c.n_kv_heads, c.head_dim, self.device, self.model.kv_dtype)

    def _hidden(self, ids: list[int], cache: FullKVCache, all_positions: bool) -> torch.Tensor:
        start = cache.n_tokens
        t = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.arange(start, start + len(ids), dtype=torch.long, device=self.device)
        h = self.model.forward(t, pos, cache, all_logits=all_positions, return_hidden=True)
        cache.end_forward(ids, "")
        return h if all_positions else h[None]

    def step_rewards(self, question: str, steps: list[str]) -> list[float]:
        """Reward of every step (one full forward over the conversation).

        Raises:
            ValueError: no steps.
        """
        if not steps:
            raise ValueError("step_rewards needs at least one step")
        ids = self.conversation(question, steps).encode()
        hidden = self._hidden(ids, self._new_cache(), all_positions=True)
        at_tags = torch.tensor([i for i, t in enumerate(ids) if t == self.tag_id], device=self.device)
        return self.rewards_from_hidden(hidden[at_tags]).tolist()

    def last_step_reward(self, question: str, steps: list[str]) -> float:
        """Reward of ``steps[-1]`` given the question and ``steps[:-1]`` — a KV-Rescue candidate's score.

        The KV of the conversation up to ``steps[:-1]`` is kept between calls, so scoring N candidates
        of one step runs the shared prefix once.

        Raises:
            ValueError: no steps.
        """
        if not steps:
            raise ValueError("last_step_reward needs at least one step")
        return self.last_step_rewards(question, steps[:-1], [steps[-1]])[0]

    def last_step_rewards(self, question: str, committed: list[str], candidates: list[str]) -> list[float]:
        """Reward of each candidate step after the question and the ``committed`` steps, all candidates in
        one batched forward (KV-Rescue scores a step's surviving candidates together).

        The committed prefix is run once and kept between calls (see :meth:`last_step_reward`); each
        candidate's own tokens (ragged lengths) continue a fork of it, and the B suffixes share one
        :meth:`~zoomr.backends.torch.model.Decoder.forward_batch`. A candidate whose tokens merge with the
        prefix's last token (the tokenizer joined across the boundary) is run whole, alone. Sets
        :attr:`last_scored_tokens` to the longest candidate's conversation (tokens).

        Args:
            question: the problem text; committed: steps already committed; candidates: B ≥ 1 step texts.
        Returns:
            B rewards, P(correct) in [0, 1], in candidate order.
        Raises:
            ValueError: no candidates.
        """
        if not candidates:
            raise ValueError("last_step_rewards needs at least one candidate")
        prefix = self.conversation(question, committed).encode()
        fulls = [self.conversation(question, committed + [c]).encode() for c in candidates]
        self.last_scored_tokens = max(len(f) for f in fulls)
        out: list[float | None] = [None] * len(fulls)
        rows = []
        for i, full in enumerate(fulls):
            if full[:len(prefix)] != prefix or len(full) == len(prefix):  # no reuse possible
                out[i] = self.rewards_from_hidden(self._hidden(full, self._new_cache(), False)).item()
            else:
                rows.append(i)
        if rows:
            if prefix != self._prefix_ids:
                self._prefix_cache = self._new_cache()
                if prefix:
                    self._hidden(prefix, self._prefix_cache, False)
                self._prefix_ids = prefix
            suffixes = [fulls[i][len(prefix):] for i in rows]
            caches = [self._prefix_cache.scoring_fork() for _ in rows]   # they keep none of the suffixes' K/V
            flat = [t for ids in suffixes for t in ids]
            pos = [p for ids in suffixes for p in range(len(prefix), len(prefix) + len(ids))]
            hidden = self.model.forward_batch(torch.tensor(flat, dtype=torch.long, device=self.device),
                                              torch.tensor(pos, dtype=torch.long, device=self.device),
                                              [len(ids) for ids in suffixes], caches, return_hidden=True)
            for i, r in zip(rows, self.rewards_from_hidden(hidden).tolist()):
                out[i] = r
        return out
