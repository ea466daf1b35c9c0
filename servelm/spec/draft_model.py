"""Draft model proposer: a smaller model with the target's vocabulary drafts k tokens, one
forward at a time (greedy), over a paged KV pool of its own.

The draft keeps its own `ModelRunner`, `KVCache` (built, with its weights and linear
tuning, by the same ModelWorker as the target's) and `BlockManager` (same block size and
block count as the target's, prefix caching as the target's). Each request's draft state
says which of its tokens the draft pool holds: `real` tokens of the sequence, then the drafts
it fed after them last time (`fed`). The next time, the drafts the target accepted are just
the start of the sequence's new tokens: the pool is valid up to `real` + the common prefix of
`fed` and those tokens, and the blocks wholly past that go back to the pool (rolled back); the
first draft forward computes every token from there on (one token after a step that accepted
everything fed; the whole prompt the first time, less a prefix-cache hit), and each of the
k - 1 forwards after it feeds the previous draft as a one-token decode. The blocks go back
when the request finishes, is aborted or preempted (`release`).

Drafts are greedy, a deterministic function of the sequence: the rejection sampler treats each
as a point mass (q(d) = 1), which keeps the target's distribution exact. Whatever the draft
pool holds, only acceptance depends on it, never the tokens emitted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from servelm.config import KernelConfig, SpeculativeConfig
from servelm.engine.block_manager import BlockManager
from servelm.engine.executor import ModelWorker
from servelm.engine.model_runner import KVCache, ModelRunner, SeqInput
from servelm.models.config import ModelConfig
from servelm.models.loader import ModelLoadError, open_checkpoint

logger = logging.getLogger(__name__)


@dataclass
class _DraftState:
    """The sequence's tokens [0, real) are in the draft pool, then `fed` drafts after them."""

    real: int = 0
    fed: list[int] = field(default_factory=list)


def check_vocabulary(path: str, draft_cfg: ModelConfig, draft_tok, target_cfg: ModelConfig,
                     target_tok) -> None:
    """ValueError naming speculative_config model unless the draft scores the target's
    tokens: the same number of logits rows and the same token for every id."""
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"speculative_config model {path!r} has a vocabulary of "
                         f"{draft_cfg.vocab_size} tokens, the target model "
                         f"{target_cfg.vocab_size}: a draft model must share the target's "
                         f"tokenizer")
    a, b = draft_tok.get_vocab(), target_tok.get_vocab()
    if a != b:
        diff = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])
        t, i = diff[0]
        raise ValueError(f"speculative_config model {path!r} has another tokenizer than the "
                         f"target model (they differ at token id {i}, {t!r}): a draft model "
                         f"must share the target's tokenizer")


class DraftModelProposer:
    """Drafts from a smaller model (SpeculativeConfig method 'draft_model')."""

    def __init__(self, spec: SpeculativeConfig, target_cfg: ModelConfig, target_tokenizer,
                 dtype: torch.dtype, device: torch.device, max_len: int,
                 quantization: str | None = None, kernels: KernelConfig | None = None):
        """Open and check the draft (vocabulary, tokenizer) and load its weights, in the
        target's dtype, device and weight quantisation. Its KV pool comes with allocate()."""
        self.path = spec.model
        try:
            ckpt = open_checkpoint(spec.model)
            self.config = ckpt.config()
            tokenizer = ckpt.tokenizer()
        except ModelLoadError as e:
            raise ValueError(f"speculative_config model: {e}") from e
        check_vocabulary(spec.model, self.config, tokenizer, target_cfg, target_tokenizer)
        self.max_len = min(max_len, self.config.max_position_embeddings)
        try:
            self.worker = ModelWorker(ckpt, self.config, dtype, device, self.max_len,
                                      quantization, kernels or KernelConfig())
        except ModelLoadError as e:
            raise ValueError(f"speculative_config model: {e}") from e
        self.model = self.worker.model
        self.kv_cache: KVCache | None = None
        self.runner: ModelRunner | None = None
        self.block_manager: BlockManager | None = None

    def bytes_per_block(self, block_size: int, kv_dtype: torch.dtype) -> int:
        return self.worker.bytes_per_block(block_size, kv_dtype)

    def allocate(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 enable_caching: bool, cuda_graphs: bool = False,
                 max_graph_batch: int = 256) -> None:
        """The draft's own KV pool (num_blocks blocks), its runner and its block tables."""
        self.worker.allocate(num_blocks, block_size, kv_dtype, cuda_graphs=cuda_graphs,
                             max_graph_batch=max_graph_batch)
        self.kv_cache, self.runner = self.worker.kv_cache, self.worker.runner
        self.block_manager = BlockManager(num_blocks, block_size, enable_caching=enable_caching)

    # ---- proposing -------------------------------------------------------------------------

    def _start(self, req, need: int) -> int | None:
        """Roll req's draft pool back to what is still valid and grow its table to `need`
        tokens; the position the first draft forward starts at, or None (no free blocks)."""
        bm = self.block_manager
        rid, n = req.request_id, req.num_tokens
        st: _DraftState | None = req.draft_state
        if st is None:
            cached = (bm.find_cached_prefix(req.token_slice(0, n), req.cache_salt)
                      if bm.enable_caching else [])
            if not bm.can_allocate(rid, need, cached):
                return None
            bm.allocate(rid, need, cached)
            req.draft_state = _DraftState(real=len(cached) * bm.block_size)
            return req.draft_state.real
        valid = st.real
        for d, t in zip(st.fed, req.token_slice(st.real, min(n, st.real + len(st.fed)))):
            if d != t:
                break
            valid += 1
        bm.truncate(rid, valid)  # the rejected drafts' blocks go back
        st.real, st.fed = valid, []
        if not bm.can_allocate(rid, need):
            return None
        bm.allocate(rid, need)
        # At least the last token runs: its logits give the first draft.
        return min(valid, n - 1)

    @torch.inference_mode()
    def propose(self, reqs: list, ks: list[int]) -> list[list[int]]:
        """Up to ks[i] greedy drafts after each reqs[i]'s tokens: one batched draft forward
        per draft position, the first also catching the draft pool up with the sequence."""
        out: list[list[int]] = [[] for _ in reqs]
        live, seqs = [], []
        for i, (req, k) in enumerate(zip(reqs, ks)):
            n = req.num_tokens
            if k < 1 or n + k - 1 > self.max_len:
                continue  # past the draft's context: no drafts
            start = self._start(req, n + k - 1)
            if start is None:
                continue  # the draft pool is full: no drafts this step
            live.append(i)
            seqs.append(SeqInput(req.token_slice(start, n), start,
                                 self.block_manager.block_table(req.request_id)))
        bm = self.block_manager
        while live:
            logits, rows = self.runner.execute(seqs)
            tokens = logits.argmax(dim=-1).tolist()
            nxt_live, nxt_seqs = [], []
            for tok, j in zip(tokens, rows):
                i, req, s = live[j], reqs[live[j]], seqs[j]
                if not out[i]:  # the first forward: the sequence itself is all computed
                    st = req.draft_state
                    st.real = req.num_tokens
                    if bm.enable_caching:
                        bm.cache_full_blocks(req.request_id, req.token_slice(0, st.real),
                                             st.real, req.cache_salt)
                out[i].append(tok)
                if len(out[i]) < ks[i]:
                    req.draft_state.fed.append(tok)
                    nxt_live.append(i)
                    nxt_seqs.append(SeqInput([tok], s.start_pos + len(s.token_ids),
                                             s.block_table))
            live, seqs = nxt_live, nxt_seqs
        return out

    def release(self, req) -> None:
        """Free req's draft blocks (it finished, was aborted or preempted)."""
        if self.block_manager is not None:
            self.block_manager.free(req.request_id)
        req.draft_state = None
