"""Verification of draft tokens: greedy prefix match, or rejection sampling that keeps the
target distribution exactly.

A speculating sequence's forward computes k + 1 logits rows: row j scores the token after
its last token and the first j drafts. Each row goes through the sampler's whole pipeline
(`Sampler.target_logits`: grammar, logit_bias, min_tokens, penalties, temperature, top-k/p,
min-p) as if the drafts before it had been accepted, giving the target distribution p_j.

- Greedy: drafts are accepted while each equals argmax p_j; then argmax at the first
  mismatch (or after the last draft) is emitted too: 1 to k + 1 tokens, exactly the tokens
  plain greedy decoding would produce.
- Sampling: draft d_j (drawn by the proposer from q_j) is accepted with probability
  min(1, p_j(d_j) / q_j(d_j)); at the first rejection a token is drawn from
  max(0, p_j - q_j), renormalised; if every draft is accepted, one more is drawn from p_k.
  The emitted tokens are then distributed exactly as tokens drawn one by one from p
  (Leviathan et al. 2023, Chen et al. 2023). An ngram draft is a point mass (q_j(d_j) = 1):
  accept with p_j(d_j), else draw from p_j with d_j removed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from servelm.engine.sampler import Sampler, TokenLogprobs, _argmax, sample_from


@dataclass
class Verified:
    """One sequence's outcome: the tokens to emit (accepted drafts, then one target token)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None  # per emitted token, when the request asked
    num_accepted: int


class _DraftRow:
    """A request as the sampler sees it at draft position j: the first j drafts appended to
    its outputs (penalties and min_tokens count them)."""

    __slots__ = ("_req", "_drafts", "sampling_params", "prompt_token_ids", "generator", "grammar")

    def __init__(self, req, drafts: list[int]):
        self._req, self._drafts = req, drafts
        self.sampling_params = req.sampling_params
        self.prompt_token_ids = req.prompt_token_ids
        self.generator = req.generator
        self.grammar = None  # requests with a grammar never speculate

    @property
    def output_token_ids(self) -> list[int]:
        return self._req.output_token_ids + self._drafts if self._drafts else self._req.output_token_ids


def _uniform(req) -> float:
    """One U[0, 1) draw from the request's own generator (seeded) or the default one."""
    gen = req.generator
    if gen is None:
        return torch.rand(1, dtype=torch.float64).item()
    return torch.rand(1, generator=gen, device=gen.device, dtype=torch.float64).item()


def verify(sampler: Sampler, logits: torch.Tensor, reqs: list, drafts: list[list[int]],
           offsets: list[int], draft_probs: list[torch.Tensor | None] | None = None
           ) -> list[Verified]:
    """Verify each request's drafts against its rows of logits [R, V] (fp32): request i's
    rows are offsets[i] .. offsets[i] + len(drafts[i]) (k + 1 of them). draft_probs[i]:
    the proposer's q rows [k, V] for request i, or None for a point-mass draft."""
    rows, proxies = [], []
    for req, d, o in zip(reqs, drafts, offsets):
        for j in range(len(d) + 1):
            rows.append(o + j)
            proxies.append(_DraftRow(req, d[:j]))
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    raw = logits.index_select(0, index).float()  # [R', V], the requests' rows in order
    final = sampler.target_logits(raw, proxies)
    starts, at = [], 0
    for d in drafts:
        starts.append(at)
        at += len(d) + 1

    greedy = [i for i, r in enumerate(reqs) if r.sampling_params.greedy]
    out: list[Verified | None] = [None] * len(reqs)
    if greedy:
        g_rows = [starts[i] + j for i in greedy for j in range(len(drafts[i]) + 1)]
        targets = _argmax(final[torch.tensor(g_rows, device=final.device)]).tolist()
        at = 0
        for i in greedy:
            d = drafts[i]
            t = targets[at:at + len(d) + 1]
            at += len(d) + 1
            a = 0
            while a < len(d) and d[a] == t[a]:
                a += 1
            out[i] = Verified(t[:a + 1], None, a)
    sampling = [i for i, r in enumerate(reqs) if not r.sampling_params.greedy]
    if sampling:
        _rejection_sample(final, reqs, drafts, starts, sampling, draft_probs, out)

    if any(r.sampling_params.logprobs is not None for r in reqs):
        _add_logprobs(raw, reqs, starts, out)
    return out  # type: ignore[return-value]


def _rejection_sample(final, reqs, drafts, starts, sampling, draft_probs, out) -> None:
    s_rows = [starts[i] + j for i in sampling for j in range(len(drafts[i]) + 1)]
    probs = final[torch.tensor(s_rows, device=final.device)].softmax(dim=-1)  # [R_s, V]
    # p_j(d_j) of every draft, read back at once.
    d_rows, d_toks, at = [], [], 0
    firsts = []
    for i in sampling:
        firsts.append(at)
        d_rows += range(at, at + len(drafts[i]))
        d_toks += drafts[i]
        at += len(drafts[i]) + 1
    dev = probs.device
    p_draft = (probs[torch.tensor(d_rows, device=dev), torch.tensor(d_toks, device=dev)].tolist()
               if d_rows else [])
    q_draft = {}
    for i in sampling:
        q = draft_probs[i] if draft_probs is not None else None
        if q is not None:
            q_draft[i] = q[torch.arange(len(drafts[i]), device=q.device),
                           torch.tensor(drafts[i], device=q.device)].tolist()
    # Host loop: accept or reject each draft in turn; then one final draw per request, from
    # the residual at the rejected position or from p after the last draft.
    final_rows, accepted, at_draft = [], [], 0
    for n, i in enumerate(sampling):
        d, req = drafts[i], reqs[i]
        a = 0
        while a < len(d):
            p = p_draft[at_draft + a]
            q = q_draft[i][a] if i in q_draft else 1.0
            if _uniform(req) * q < p:  # accept with min(1, p / q)
                a += 1
            else:
                break
        at_draft += len(d)
        accepted.append(a)
        final_rows.append(firsts[n] + a)
    last = probs[torch.tensor(final_rows, device=dev)].clone()  # [S, V]
    for n, i in enumerate(sampling):
        a = accepted[n]
        if a == len(drafts[i]):
            continue  # every draft accepted: draw from p itself
        if i in q_draft:
            q = draft_probs[i][a].to(dev, last.dtype)
            resid = (last[n] - q).clamp_(min=0.0)
            # p <= q everywhere only when they are equal (then nothing is ever rejected);
            # rounding could still leave no mass: fall back to p.
            if resid.sum() > 0:
                last[n] = resid
        else:
            last[n, drafts[i][a]] = 0.0  # point mass: p with the draft removed
    u = torch.tensor([_uniform(reqs[i]) for i in sampling], dtype=torch.float64)
    toks = sample_from(last, u).tolist()
    for n, i in enumerate(sampling):
        a = accepted[n]
        out[i] = Verified(drafts[i][:a] + [toks[n]], None, a)


def _add_logprobs(raw, reqs, starts, out) -> None:
    """Each emitted token's logprob under the raw model logits of its own row (as the plain
    sampler reports them)."""
    want = [i for i, r in enumerate(reqs) if r.sampling_params.logprobs is not None]
    rows, toks, params = [], [], []
    for i in want:
        v = out[i]
        rows += range(starts[i], starts[i] + len(v.token_ids))
        toks += v.token_ids
        params += [reqs[i].sampling_params] * len(v.token_ids)
    dev = raw.device
    lp = torch.log_softmax(raw[torch.tensor(rows, device=dev)], dim=-1)
    got = Sampler._gather_logprobs(lp, torch.tensor(toks, dtype=torch.long, device=dev), params)
    at = 0
    for i in want:
        n = len(out[i].token_ids)
        out[i].logprobs = got[at:at + n]
        at += n
