"""Host-side preparation of one step: scheduled rows -> `StepInputs` numpy arrays for staging.

Runs on the CPU while the previous step's forward runs on the GPU, so it must never touch a device
tensor. Token ids are not staged for decode rows: their input token is already in the device token
pool (written by the previous step's sampler); only tokens the pool lacks (prompt chunks, recompute
after preemption, a new request) are written from the host. The builders read the runner's
`RequestTable` and never write it: the runner records what the step leaves in the pool
(`HostStep.pool_valid`) once the step is staged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from photon.core.inputs import SamplingFlags, StepInputs
from photon.core.sampling import IntCol
from photon.core.step import ScheduledRow
from photon.worker.request_table import I64, RequestTable


@dataclass(frozen=True, slots=True)
class PromptSpan:
    """Prompt tokens [first, first + count) of row `row` are scored this step (their logprobs
    come from the logits of the positions before them), with `k` top logprobs each."""

    row: int
    first: int
    count: int
    k: int


@dataclass(slots=True)
class HostStep:
    """A step's inputs on the host, and what the host keeps of them."""

    inputs: StepInputs[np.ndarray]
    seq_lens: list[int]
    query_lens: list[int]
    decode_only: bool
    sample_rows: list[int]  # indices of rows that sample, in sampling order
    flags: SamplingFlags
    # (request indices, pool_valid after this step): the pool holds each row's inputs, and its
    # sampled token once the step samples.
    pool_valid: tuple[np.ndarray, np.ndarray]
    prompt_spans: list[PromptSpan] = field(default_factory=list)  # in plp_idx order
    # Sampling rows of each row that samples (sample_rows order): 1, or K + 1 for a speculative
    # row; None: 1 each (no speculative row).
    widths: list[int] | None = None
    spec_k: int = 0  # K_eff of the step's speculative rows (all verify as many drafts)
    padding: int = 0  # padding rows (one token each) after the step's rows: pad_tokens
    bucket: int = 0  # the piecewise graphs' token bucket the step runs in (0: op by op)
    # Every row a speculative row verifying spec_k drafts (decode_inputs.build_spec_inputs,
    # which the runner uses for every such step): the speculative graphs' steps.
    uniform_spec: bool = False
    # The step skips the draft model's catch-up forward (photon.worker.draft_lag)
    skip_draft: bool = False

    @property
    def only_spec(self) -> bool:
        """Every sampling row belongs to a speculative row (a speculative decode step)."""
        return self.widths is not None and len(self.inputs.spec_rows) == len(self.sample_rows)

    @property
    def num_virtual(self) -> int:
        """Sampling rows in all: the sampler's batch (one per query position of speculative
        rows)."""
        return len(self.sample_rows) if self.widths is None else sum(self.widths)

    @property
    def prompt_k(self) -> int:
        """The most top logprobs a prompt span wants; -1: no prompt logprobs this step."""
        return max((s.k for s in self.prompt_spans), default=-1)


def i64(values: list[int]) -> np.ndarray:
    return np.fromiter(values, dtype=I64, count=len(values))


def token_arrays(rows: list[ScheduledRow], table: RequestTable, block_size: int,
                  pool_width: int) -> tuple[np.ndarray, ...]:
    """(positions, pool_idx, slot_mapping, write_idx, write_ids). Decode rows (one token) take a
    scalar path: this runs for every row of every step, so it avoids per-row numpy calls."""
    positions: list[int] = []
    pool_idx: list[int] = []
    slots: list[int] = []
    write_idx: list[int] = []
    write_ids: list[int] = []
    bs = block_size
    for row in rows:
        base = row.req_index * pool_width
        start, end = row.start, row.seq_len
        if row.speculative:  # resolved on the device at launch; every token is in the pool
            n = row.num_tokens
            positions.extend([0] * n)
            pool_idx.extend([base] * n)
            slots.extend([0] * n)
            continue
        if end - start == 1:
            positions.append(start)
            pool_idx.append(base + start)
            slots.append(row.block_ids[start // bs] * bs + start % bs)
        else:
            pos = np.arange(start, end, dtype=I64)
            blocks = np.asarray(row.block_ids, dtype=I64)
            positions.extend(pos.tolist())
            pool_idx.extend((base + pos).tolist())
            slots.extend((blocks[pos // bs] * bs + pos % bs).tolist())
        first, toks = table.missing_tokens(row.req_index, end)
        if toks:
            write_idx.extend(range(base + first, base + end))
            write_ids.extend(toks)
    return i64(positions), i64(pool_idx), i64(slots), i64(write_idx), i64(write_ids)


def row_block_tables(rows: list[ScheduledRow], block_size: int) -> np.ndarray:
    """Zero-padded (the null block): a speculative row's table spans its host bound of seq_len,
    so the device finds every position it may resolve in it."""
    width = max(max(len(r.block_ids), -(-r.seq_len // block_size) if r.speculative else 0)
                for r in rows)
    tables = np.zeros((len(rows), width), dtype=I64)
    for i, r in enumerate(rows):
        tables[i, : len(r.block_ids)] = r.block_ids
    return tables


def prompt_logprob_arrays(rows: list[ScheduledRow], table: RequestTable, query_start: np.ndarray
                          ) -> tuple[np.ndarray, np.ndarray, list[PromptSpan]]:
    """(hidden-state index, prompt token) of every prompt token scored this step, and the spans.
    Rows of requests that want prompt logprobs score the prompt tokens following their computed
    positions (the first prompt token has no logprob)."""
    idx: list[int] = []
    tokens: list[int] = []
    spans: list[PromptSpan] = []
    for i, row in enumerate(rows):
        k = int(table.prompt_k[row.req_index])
        if k < 0:
            continue
        prompt = table.tokens[row.req_index]
        end = min(row.seq_len, int(table.ints[row.req_index, IntCol.PROMPT_LEN]) - 1)
        if row.start >= end:
            continue
        count = end - row.start
        base = int(query_start[i])
        idx.extend(range(base, base + count))
        tokens.extend(prompt[row.start + 1:end + 1])
        spans.append(PromptSpan(i, row.start + 1, count, k))
    return i64(idx), i64(tokens), spans


@dataclass(slots=True)
class _Sampling:
    """The sampling rows of a step (a speculative row has K + 1, placeholders for the values
    the launch resolves on the device)."""

    rows: list[int]  # the rows that sample
    widths: list[int]
    req: np.ndarray
    counters: np.ndarray
    seq_lens: np.ndarray
    logits_idx: np.ndarray
    spec_rows: np.ndarray
    spec_vrows: np.ndarray


def _sampling(rows: list[ScheduledRow], qsl: np.ndarray) -> _Sampling:
    sample = [i for i, r in enumerate(rows) if r.sample]
    widths = [rows[i].spec + 1 for i in sample]
    req: list[int] = []
    counters: list[int] = []
    seq_lens: list[int] = []
    logits: list[int] = []
    spec_rows: list[int] = []
    spec_vrows: list[int] = []
    for i, w in zip(sample, widths):
        r = rows[i]
        if r.speculative:
            spec_rows.append(i)
            spec_vrows.append(len(req))
        req.extend([r.req_index] * w)
        counters.extend([r.out_index] * w)
        seq_lens.extend([r.seq_len] * w)
        end = int(qsl[i + 1])
        logits.extend(range(end - w, end))
    return _Sampling(sample, widths, i64(req), i64(counters), i64(seq_lens), i64(logits),
                     i64(spec_rows), i64(spec_vrows))


def build_step_inputs(rows: list[ScheduledRow], table: RequestTable, block_size: int,
                      pool_width: int) -> HostStep:
    """Any mix of prefill chunks, decode rows and speculative rows."""
    positions, pool_idx, slots, write_idx, write_ids = token_arrays(rows, table, block_size,
                                                                     pool_width)
    qlens = [r.num_tokens for r in rows]
    qsl = np.zeros(len(rows) + 1, dtype=I64)
    np.cumsum(i64(qlens), out=qsl[1:])
    smp = _sampling(rows, qsl)
    req = smp.req
    g = table.gather(req, smp.counters)
    ban_rows, ban_tokens, ban_until = table.min_tokens_bans(req, g.below_min_tokens)
    bias_rows, bias_tokens, bias_values = table.logit_bias(req, g.biased)
    plp_idx, plp_tokens, spans = prompt_logprob_arrays(rows, table, qsl)
    seq_lens = [r.seq_len for r in rows]
    sampled_req = i64([rows[i].req_index for i in smp.rows])
    inputs = StepInputs(
        positions, pool_idx, slots, write_idx, write_ids, i64(seq_lens), qsl,
        row_block_tables(rows, block_size), smp.logits_idx, g.top_k, g.keys, smp.counters, req,
        g.prompt_lens, smp.seq_lens, req * pool_width + smp.seq_lens, ban_rows, ban_tokens,
        ban_until, bias_rows, bias_tokens, plp_idx, plp_tokens, smp.spec_rows,
        i64([rows[i].req_index for i in smp.spec_rows.tolist()]), smp.spec_vrows,
        sampled_req[table.spec[sampled_req] > 0],
        np.repeat(table.lora[i64([r.req_index for r in rows])], qlens), *g.floats, bias_values)
    # After a speculative row the device keeps the request's pool complete up to its length
    # (every later row's inputs are there: the host never writes them).
    valid = i64([pool_width if r.speculative else r.seq_len + int(r.sample) for r in rows])
    return HostStep(inputs, seq_lens, qlens, all(q == 1 for q in qlens), smp.rows, g.flags,
                    (i64([r.req_index for r in rows]), valid), spans,
                    smp.widths if smp.spec_rows.size else None,
                    max((r.spec for r in rows), default=0))


def pad_token_arrays(inputs: StepInputs[np.ndarray], count: int) -> None:
    """Append `count` padding tokens to the per-token arrays: position 0, pool entry 0, KV slot
    0 of the null block 0, LoRA slot 0 (no adapter)."""
    zeros = np.zeros(count, dtype=I64)
    inputs.positions = np.concatenate([inputs.positions, zeros])
    inputs.pool_idx = np.concatenate([inputs.pool_idx, zeros])
    inputs.slot_mapping = np.concatenate([inputs.slot_mapping, zeros])
    inputs.lora_slots = np.concatenate([inputs.lora_slots, zeros])


def pad_tokens(host: HostStep, num_tokens: int) -> None:
    """Append padding rows of one token each until the step holds `num_tokens` tokens, as a
    CUDA graph's padding rows: position 0, pool entry 0, no adapter, K/V written into slot 0
    of the null block 0 and attending over that one position. Sampling fields are untouched:
    padding rows never sample."""
    inp = host.inputs
    pad = num_tokens - inp.positions.shape[0]
    if pad <= 0:
        return
    pad_token_arrays(inp, pad)
    inp.seq_lens = np.concatenate([inp.seq_lens, np.ones(pad, dtype=I64)])
    end = inp.query_start_loc[-1]
    inp.query_start_loc = np.concatenate([inp.query_start_loc, end + np.arange(1, pad + 1)])
    tables = inp.block_tables
    inp.block_tables = np.concatenate([tables, np.zeros((pad, tables.shape[1]), dtype=I64)])
    host.seq_lens = host.seq_lens + [1] * pad
    host.query_lens = host.query_lens + [1] * pad
    host.padding = pad
