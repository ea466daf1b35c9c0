"""Sampler: turns one decode step's logits into one next token per request.

Pipeline, each stage one batched tensor op over the rows that use it and
skipped entirely when no row does:

    raw logprobs -> min_tokens ban -> repetition penalty
    -> frequency/presence penalties -> greedy argmax
    | temperature -> top-k -> top-p -> min-p -> sample

Sampling inverts each row's cumulative distribution at one uniform draw
``u``: the first token whose cumulative probability exceeds ``u`` is taken.
One random number per row (not one per vocabulary entry) keeps the draw cheap,
and drawing ``u`` from the row's own generator makes seeded requests
reproducible whatever else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from servelm.kernels import load_ops
from servelm.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class TokenLogprobs:
    """Log-probabilities (under the raw model logits) for one sampled token."""

    token_id: int
    logprob: float  # log-probability of the sampled token
    rank: int  # 1 = it was the most likely token
    top: list[tuple[int, float]]  # top-N (token_id, logprob), most likely first


@dataclass
class SamplerOutput:
    """One sampling step's result, in the order of the rows passed in."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


class SamplerRow(Protocol):
    """What the sampler needs from a request (the engine's Request satisfies this)."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None  # set when sampling_params.seed is not None
    grammar: object  # a structured-outputs matcher, or None


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` ([B] long, the first maximum, NaN counted largest). On the
    CPU with the C++ kernels, an AVX-512 op over the threads: PyTorch's CPU argmax is scalar
    and takes one thread (~28 us a 49152-entry row, ~870 us for 64 rows, against ~3 and ~75)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and load_ops("ops"):
        return torch.ops.servelm_ops.argmax_rows(logits)
    return logits.argmax(dim=-1)


def _apply_grammars(logits: torch.Tensor, rows: Sequence[SamplerRow],
                    constrained: list[int], prefetched=None) -> torch.Tensor:
    """-inf for every token the row's grammar does not allow next (a copy of the logits).
    prefetched: a structured_outputs.MaskPrefetch holding some rows' masks already."""
    from servelm.structured_outputs import allowed_mask

    got = {i: prefetched.get(rows[i].grammar) for i in constrained} if prefetched else {}
    rest = [i for i in constrained if got.get(i) is None]
    if prefetched is not None:
        prefetched.wait()  # (one llguidance executor: never two threads on it at once)
    if rest:
        for i, mask in zip(rest, allowed_mask([rows[i].grammar for i in rest],
                                              logits.shape[1])):
            got[i] = mask
    allowed = torch.stack([got[i][:logits.shape[1]] for i in constrained])
    index = torch.tensor(constrained, device=logits.device)
    logits = logits.clone()
    logits[index] = logits[index].masked_fill(~allowed.to(logits.device), _NEG_INF)
    return logits


def _apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplerRow]) -> torch.Tensor:
    """Each row's logit_bias added to its logits (a copy)."""
    r, t, b = [], [], []
    for i, row in enumerate(rows):
        for tok, bias in (row.sampling_params.logit_bias or {}).items():
            r.append(i)
            t.append(tok)
            b.append(bias)
    logits = logits.clone()
    dev = logits.device
    logits.index_put_((torch.tensor(r, device=dev), torch.tensor(t, device=dev)),
                      torch.tensor(b, dtype=logits.dtype, device=dev), accumulate=True)
    return logits


def _argmax_only(row: SamplerRow) -> bool:
    """Whether the whole pipeline reduces to an argmax for this row: greedy, no penalty,
    no logprobs, and past min_tokens (so no token is banned)."""
    p = row.sampling_params
    return (p.greedy and p.logprobs is None and p.repetition_penalty == 1.0
            and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0
            and len(row.output_token_ids) >= p.min_tokens)


def checks_grammar_after(row: SamplerRow) -> bool:
    """Whether a constrained row's token is chosen first and checked against its grammar
    after (the mask computed only when the grammar rejects it): exact for a row whose token
    is the argmax, since the argmax over the allowed tokens is the argmax over all of them
    whenever that one is allowed (llama.cpp's sampler checks its grammar the same way)."""
    return getattr(row, "grammar", None) is not None and _argmax_only(row)


def _recheck_grammars(logits: torch.Tensor, token_ids: list[int],
                      rows: Sequence[SamplerRow], checked: list[int]) -> list[int]:
    """token_ids with each checked row's token replaced, where its grammar rejects it, by the
    argmax over the tokens the grammar allows (their masks computed for those rows only)."""
    rejected = [i for i in checked if rows[i].grammar.validate_tokens([token_ids[i]]) != 1]
    if rejected:
        sub = [rows[i] for i in rejected]
        masked = _apply_grammars(logits[rejected], sub, list(range(len(rejected))))
        for i, tok in zip(rejected, _argmax(masked).tolist()):
            token_ids[i] = tok
    return token_ids


class Sampler:
    """Chooses the next token for every row of a batch of logits."""

    def __init__(self, eos_token_ids: frozenset[int] | set[int], check_grammar_after: bool = True):
        """``eos_token_ids``: banned while a row has fewer than min_tokens outputs.
        ``check_grammar_after``: greedy constrained rows take their argmax and compute a mask
        only when the grammar rejects it (`checks_grammar_after`); False masks every
        constrained row first (the reference the check is tested against)."""
        self.eos_token_ids = frozenset(eos_token_ids)
        self.check_grammar_after = check_grammar_after

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplerRow],
                 masks=None) -> SamplerOutput:
        """Sample one token per row.

        ``logits`` is ``[len(rows), vocab]``; all work happens on its device and
        it is never modified. A row's ``generator`` may live on any device. ``masks``:
        a structured_outputs.MaskPrefetch with grammars' masks computed during the forward.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [{len(rows)}, vocab], got {tuple(logits.shape)}")
        if not rows:
            return SamplerOutput(token_ids=[], logprobs=[])
        logits = raw = logits.float()
        constrained = [i for i, row in enumerate(rows) if getattr(row, "grammar", None) is not None]
        checked = [i for i in constrained if checks_grammar_after(rows[i])] \
            if self.check_grammar_after else []
        masked = [i for i in constrained if i not in checked] if checked else constrained
        if masked:  # structured outputs: only the tokens each grammar allows next
            logits = _apply_grammars(logits, rows, masked, masks)
        elif masks is not None:
            masks.wait()  # (its buffer must outlive the background work)
        if any(row.sampling_params.logit_bias for row in rows):
            logits = _apply_logit_bias(logits, rows)
        if all(_argmax_only(row) for row in rows):  # the common greedy step: one op
            token_ids = _argmax(logits).tolist()
            if checked:
                token_ids = _recheck_grammars(logits, token_ids, rows, checked)
            return SamplerOutput(token_ids=token_ids, logprobs=[None] * len(rows))
        params = [row.sampling_params for row in rows]

        # Reported logprobs come from the model's own distribution, before any
        # grammar, penalty or warping (vLLM's default "raw_logprobs" mode).
        raw_logprobs = None
        if any(p.logprobs is not None for p in params):
            raw_logprobs = torch.log_softmax(raw, dim=-1)  # [B, V]

        logits = self._ban_stop_tokens(logits, rows)
        logits = self._apply_penalties(logits, rows)
        token_ids = self._choose(logits, rows)  # [B]
        if checked:  # (their rows are greedy, past min_tokens and unpenalised)
            token_ids = torch.tensor(_recheck_grammars(logits, token_ids.tolist(), rows, checked),
                                     device=token_ids.device)

        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        if raw_logprobs is not None:
            logprobs = self._gather_logprobs(raw_logprobs, token_ids, params)
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)

    def target_logits(self, logits: torch.Tensor, rows: Sequence[SamplerRow]) -> torch.Tensor:
        """Each row's logits after every stage that shapes its distribution (grammar,
        logit_bias, the min_tokens ban, penalties; for rows that sample, temperature, top-k,
        top-p and min-p): a greedy row's token is their argmax, a sampling row's is drawn
        from their softmax. Speculative verification judges drafts against these."""
        logits = logits.float()
        constrained = [i for i, row in enumerate(rows) if getattr(row, "grammar", None) is not None]
        if constrained:
            logits = _apply_grammars(logits, rows, constrained)
        if any(row.sampling_params.logit_bias for row in rows):
            logits = _apply_logit_bias(logits, rows)
        if all(_argmax_only(row) for row in rows):
            return logits
        logits = self._apply_penalties(self._ban_stop_tokens(logits, rows), rows)
        keep = [i for i, row in enumerate(rows) if not row.sampling_params.greedy]
        if not keep:
            return logits
        if len(keep) == len(rows):
            return self._warp(logits, rows)
        idx = torch.tensor(keep, dtype=torch.long, device=logits.device)
        logits = logits.clone()
        logits[idx] = self._warp(logits[idx], [rows[i] for i in keep])
        return logits

    def _ban_stop_tokens(self, logits: torch.Tensor, rows: Sequence[SamplerRow]) -> torch.Tensor:
        """Forbid EOS and stop tokens for rows still short of min_tokens."""
        vocab = logits.shape[1]
        row_idx: list[int] = []
        tok_idx: list[int] = []
        for i, row in enumerate(rows):
            p = row.sampling_params
            if len(row.output_token_ids) < p.min_tokens:
                for tok in self.eos_token_ids.union(p.stop_token_ids):
                    if tok < vocab:
                        row_idx.append(i)
                        tok_idx.append(tok)
        if not row_idx:
            return logits
        logits = logits.clone()  # the caller's tensor stays untouched
        index = torch.tensor([row_idx, tok_idx], dtype=torch.long, device=logits.device)
        logits[index[0], index[1]] = _NEG_INF
        return logits

    def _apply_penalties(self, logits: torch.Tensor, rows: Sequence[SamplerRow]) -> torch.Tensor:
        """Repetition (HF, prompt + output) then frequency/presence (OpenAI, output only)."""
        params = [row.sampling_params for row in rows]
        device = logits.device
        vocab = logits.shape[1]

        rep = [p.repetition_penalty for p in params]
        if any(r != 1.0 for r in rep):
            seen = _token_counts(
                [row.prompt_token_ids + row.output_token_ids if r != 1.0 else []
                 for row, r in zip(rows, rep)],
                vocab, device,
            ) > 0  # [B, V]
            penalty = torch.tensor(rep, dtype=logits.dtype, device=device).unsqueeze(1)  # [B, 1]
            # Dividing a negative logit would make it *more* likely, hence the split.
            penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, penalised, logits)

        freq = [p.frequency_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        if any(f != 0.0 or q != 0.0 for f, q in zip(freq, pres)):
            counts = _token_counts(
                [row.output_token_ids if f != 0.0 or q != 0.0 else []
                 for row, f, q in zip(rows, freq, pres)],
                vocab, device,
            ).to(logits.dtype)  # [B, V]
            freq_t = torch.tensor(freq, dtype=logits.dtype, device=device).unsqueeze(1)  # [B, 1]
            pres_t = torch.tensor(pres, dtype=logits.dtype, device=device).unsqueeze(1)  # [B, 1]
            logits = logits - freq_t * counts - pres_t * (counts > 0).to(logits.dtype)
        return logits

    def _choose(self, logits: torch.Tensor, rows: Sequence[SamplerRow]) -> torch.Tensor:
        """Argmax for greedy rows, random sampling for the rest; returns [B] long."""
        greedy = [row.sampling_params.greedy for row in rows]
        if all(greedy):
            return _argmax(logits)
        if not any(greedy):
            return self._sample(logits, rows)
        token_ids = _argmax(logits)  # [B]; sampled rows overwritten below
        keep = [i for i, g in enumerate(greedy) if not g]
        idx = torch.tensor(keep, dtype=torch.long, device=logits.device)
        token_ids[idx] = self._sample(logits[idx], [rows[i] for i in keep])
        return token_ids

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplerRow]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then one random draw per row; [B] long."""
        probs = self._warp(logits, rows).softmax(dim=-1)  # [B, V]
        return sample_from(probs, _uniform(rows, logits.device))

    def _warp(self, logits: torch.Tensor, rows: Sequence[SamplerRow]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p: the logits a sampling row draws from."""
        params = [row.sampling_params for row in rows]
        device = logits.device

        temps = [p.temperature for p in params]
        if any(t != 1.0 for t in temps):
            logits = logits / torch.tensor(temps, dtype=logits.dtype, device=device).unsqueeze(1)

        logits = _top_k_top_p(logits, params)

        min_p = [p.min_p for p in params]
        if any(m > 0.0 for m in min_p):
            # prob / max_prob is unchanged by renormalisation, so earlier masking doesn't matter.
            probs = logits.softmax(dim=-1)  # [B, V]
            threshold = torch.tensor(min_p, dtype=probs.dtype, device=device).unsqueeze(1) \
                * probs.amax(dim=-1, keepdim=True)  # [B, 1]
            logits = logits.masked_fill(probs < threshold, _NEG_INF)
        return logits

    @staticmethod
    def _gather_logprobs(
        raw_logprobs: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]
    ) -> list[TokenLogprobs | None]:
        """Sampled-token logprob, rank and top-N for rows that asked for logprobs."""
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        idx = torch.tensor(wanted, dtype=torch.long, device=raw_logprobs.device)
        found = token_logprobs(raw_logprobs[idx], token_ids[idx],
                               [params[i].logprobs for i in wanted])
        out: list[TokenLogprobs | None] = [None] * len(params)
        for i, entry in zip(wanted, found):
            out[i] = entry
        return out


def token_logprobs(lp: torch.Tensor, token_ids: torch.Tensor, ks: list[int]
                   ) -> list[TokenLogprobs]:
    """lp: log-probabilities [R, V]; token_ids: [R] long. Each row's token's logprob and
    rank, and its top ks[r] (token_id, logprob) pairs, most likely first."""
    chosen_lp = lp.gather(1, token_ids.unsqueeze(1))  # [R, 1]
    ranks = (lp > chosen_lp).sum(dim=-1) + 1  # [R]; ties share the better rank
    n = min(max(ks), lp.shape[1])
    top_lp, top_ids = lp.topk(n, dim=-1)  # [R, n], sorted most likely first
    rows = zip(ks, token_ids.tolist(), chosen_lp.squeeze(1).tolist(), ranks.tolist(),
               top_ids.tolist(), top_lp.tolist())
    return [TokenLogprobs(token_id=tok, logprob=tok_lp, rank=rank, top=list(zip(ids[:k], lps[:k])))
            for k, tok, tok_lp, rank, ids, lps in rows]


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [B, V] (not necessarily normalised) at the uniform draws
    u [B]: the first whose cumulative mass exceeds u times the row's total; [B] long."""
    cdf = probs.cumsum(dim=-1)  # [B, V]
    u = u.to(device=probs.device, dtype=cdf.dtype).unsqueeze(1) * cdf[:, -1:]  # [B, 1]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each row's list: [B, V] long, via one scatter_add."""
    width = max((len(toks) for toks in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, dtype=torch.long, device=device)
    if width == 0:
        return counts[:, :vocab]
    # Pad with id `vocab`: a spare column that is dropped afterwards. Out-of-range
    # ids land there too rather than crashing the step.
    padded = [toks + [vocab] * (width - len(toks)) for toks in token_lists]
    ids = torch.tensor(padded, dtype=torch.long, device=device).clamp_(0, vocab)  # [B, L]
    counts.scatter_add_(1, ids, torch.ones_like(ids))
    return counts[:, :vocab]


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask tokens outside each row's top-k, then outside its top-p nucleus.

    Both work on one descending sort. Top-p sees the distribution renormalised
    after top-k, as in HF and vLLM.
    """
    vocab = logits.shape[1]
    use_k = any(0 < p.top_k < vocab for p in params)
    use_p = any(p.top_p < 1.0 for p in params)
    if not (use_k or use_p):
        return logits
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V] each

    if use_k:
        k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                         dtype=torch.long, device=device)  # [B]
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))  # [B, 1]
        # Compare by value so tokens tied with the k-th survive (HF semantics).
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)

    if use_p:
        # Disabled rows get p = inf: rounding in cumsum can exceed 1.0 and
        # must not clip their tail.
        top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params],
                             dtype=logits.dtype, device=device).unsqueeze(1)  # [B, 1]
        probs = sorted_logits.softmax(dim=-1)  # [B, V]
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly earlier tokens
        # Keep a token while the tokens before it have not yet reached p: the
        # smallest prefix whose mass reaches p. The first token is always kept.
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, _NEG_INF)

    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _uniform(rows: Sequence[SamplerRow], device: torch.device) -> torch.Tensor:
    """One U[0, 1) draw per row [B] (float32): seeded rows from their own generator."""
    seeded = [row.generator is not None for row in rows]
    u = torch.empty(len(rows), dtype=torch.float64)
    if not all(seeded):
        # The default RNG is touched only for unseeded rows, so a seeded run leaves it alone.
        fresh = torch.rand(len(rows) - sum(seeded), dtype=torch.float64)
        u[torch.tensor([not s for s in seeded])] = fresh
    for i, row in enumerate(rows):
        if seeded[i]:
            gen = row.generator
            # Draw on the generator's device so a CUDA generator works too.
            u[i] = torch.rand(1, generator=gen, device=gen.device, dtype=torch.float64).item()
    return u.to(device=device, dtype=torch.float32)
