"""Lookup drafts: n-gram continuations from the target's own answers and from the running sequence.

A drafter trained for a few CPU hours accepts its first draft about a third of the time, while the target's own greedy
answers repeat themselves a lot: a 135M chat model writes the same phrases, list markers and code scaffolding again
and again. `NgramLookup` turns the self-distilled training data (the same folders the drafter trains on) into a
backoff n-gram table, and adds the n-grams of the sequence being generated (prompt lookup, done with counts and
longest matches instead of the first match). Each proposed token carries a *calibrated* acceptance estimate, so its
drafts enter the same throughput objective as the DSpark drafter's confidence-head survival.

* **Corpus table.** For every order n = 1..N, every n-token window that precedes an answer token (the window may reach
  back into the prompt) is hashed (64-bit polynomial hash, one sorted array per order) together with the most frequent
  next token, its count and the window's total count. Lookup backs off from the longest order that matches.
* **Context table.** The same statistics computed on the fly over the current sequence (prompt + generated tokens):
  the longest suffix that occurred before, its most frequent continuation (ties: the most recent), count and total.
* **Calibration.** `build` holds out a share of the sequences, builds the table on the rest, walks the held-out
  answers and records, per source (corpus / context), order, purity bucket (best count / total) and count bucket,
  how often the proposed token is the target's next token. `P(accept)` of a proposal is that bucket's rate (with a
  prior toward the purity for sparse buckets); a proposed sequence's prefix survival is the product. The final
  table is then rebuilt on all sequences.
* **Losslessness.** A lookup draft is a *deterministic* function of the sequence so far, i.e. a point-mass draft
  distribution: greedy verification compares tokens, and rejection sampling with q = one-hot(x) accepts x with
  probability p_target(x) and otherwise samples from p_target with x removed, which is exact. Whether a round uses
  lookup drafts (and how many) is decided from the sequence alone, never from a sampled draft token, so the choice
  cannot bias sampled output (see `candidate_generator`).

Stored as safetensors (`save` / `load`: arrays only, no pickle; written atomically). Imports nothing from `dspark_hf`
by absolute path (it travels with the drafter's remote code).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ..provenance import make_shareable

__all__ = ["LookupContext", "LookupProposal", "NgramLookup", "lookup_block", "merge_lookup_drafts"]

_P = np.uint64(0x9E3779B97F4A7C15)  # odd multiplier of the polynomial window hash (arithmetic wraps mod 2^64)
_PURITY_BUCKETS = 5
_COUNT_BUCKETS = 4  # totals 1, 2, 3, >= 4 (index 0 unused)
_SOURCES = ("corpus", "context")
_FORMAT = "dspark-ngram-lookup-v2"


def _window_hashes(ids: np.ndarray, max_order: int) -> list[np.ndarray]:
    """`H[n][k]`: hash of the window `ids[k : k + n]` (n = 1..max_order; H[0] is empty)."""
    x = ids.astype(np.uint64) + np.uint64(1)
    out = [np.empty(0, dtype=np.uint64), x]
    with np.errstate(over="ignore"):
        for n in range(2, max_order + 1):
            prev = out[-1]
            if len(prev) <= 1:
                out.append(np.empty(0, dtype=np.uint64))
                continue
            out.append(prev[:-1] * _P + x[n - 1:])
    return out


_MASK = (1 << 64) - 1
_P_INT = int(_P)


def _suffix_hashes(seq: Sequence[int], max_order: int, end: int | None = None) -> list[int]:
    """`[0, h_1, ..., h_m]`: the hash of the last n tokens of `seq[:end]` for n = 1..m, m = min(max_order, end), as
    Python ints (the values `_window_hashes` gives those windows, from one pass over at most `max_order` tokens)."""
    end = len(seq) if end is None else end
    out, h, power = [0], 0, 1
    for n in range(1, min(max_order, end) + 1):
        h = (h + (int(seq[end - n]) + 1) * power) & _MASK
        power = (power * _P_INT) & _MASK
        out.append(h)
    return out


def _match_length(arr: Sequence[int], starts: Sequence[int], n: int, max_order: int) -> int:
    """How far back (up to 2 * max_order tokens) the order-`n` windows starting at `starts` (ascending) keep matching
    the suffix of `arr`: the most recent few only (enough to tell a copy from a coincidence)."""
    cap = 2 * max_order
    length = len(arr)
    best = n
    for k in starts[::-1][:8]:
        k = int(k)
        m = n
        while m < cap and k - (m - n) - 1 >= 0 and arr[k - (m - n) - 1] == arr[length - m - 1]:
            m += 1
        best = max(best, m)
        if best == cap:
            break
    return best


def _length_buckets(max_order: int) -> int:
    """Match-length buckets of the calibration table: corpus orders reach `max_order`, context matches are followed
    back up to `2 * max_order` tokens (a long copy from the prompt is far more reliable than an 8-token match)."""
    return 2 * max_order + 1


def _purity_bucket(best: int, total: int) -> int:
    return min(int(_PURITY_BUCKETS * best / total), _PURITY_BUCKETS - 1)


def _count_bucket(total: int) -> int:
    return min(int(total), _COUNT_BUCKETS - 1)


@dataclass
class LookupProposal:
    """Lookup drafts for one sequence.

    Attributes:
        tokens: proposed continuation (up to the requested number of tokens; may be empty).
        acceptance: per token, the calibrated estimate that it is accepted given the earlier ones were.
        sources: per token, "corpus" or "context".
    """

    tokens: list[int]
    acceptance: list[float]
    sources: list[str]

    @property
    def survival(self) -> list[float]:
        """Prefix survival a_j = prod_{i<=j} acceptance_i."""
        out, s = [], 1.0
        for a in self.acceptance:
            s *= a
            out.append(s)
        return out

    def truncate(self, n: int) -> "LookupProposal":
        return LookupProposal(self.tokens[:n], self.acceptance[:n], self.sources[:n])


class _Table:
    """One order's corpus statistics: sorted window hashes with their best next token, its count and the total."""

    def __init__(self, keys: np.ndarray, best: np.ndarray, count: np.ndarray, total: np.ndarray) -> None:
        self.keys, self.best, self.count, self.total = keys, best, count, total

    def pruned(self, min_total: int) -> "_Table":
        keep = self.total >= min_total
        return _Table(self.keys[keep], self.best[keep], self.count[keep], self.total[keep])

    @classmethod
    def from_pairs(cls, keys: np.ndarray, nexts: np.ndarray) -> "_Table":
        if keys.size == 0:
            z = np.empty(0, dtype=np.int64)
            return cls(np.empty(0, dtype=np.uint64), z.astype(np.int32), z.astype(np.int32), z.astype(np.int32))
        order = np.lexsort((nexts, keys))
        k, t = keys[order], nexts[order]
        # runs of equal (key, next): their counts
        new_pair = np.ones(len(k), dtype=bool)
        new_pair[1:] = (k[1:] != k[:-1]) | (t[1:] != t[:-1])
        starts = np.flatnonzero(new_pair)
        pair_count = np.diff(np.append(starts, len(k)))
        pk, pt = k[starts], t[starts]
        # per key: total, and the next token of highest count (ties: the smaller id, which sorts first)
        new_key = np.ones(len(pk), dtype=bool)
        new_key[1:] = pk[1:] != pk[:-1]
        kstarts = np.flatnonzero(new_key)
        total = np.add.reduceat(pair_count, kstarts)
        group = np.cumsum(new_key) - 1
        # stable sort by (group, -count): the first row of each group is its best pair
        pick = np.lexsort((-pair_count, group))
        first = np.ones(len(pick), dtype=bool)
        first[1:] = group[pick][1:] != group[pick][:-1]
        best_rows = pick[first]
        return cls(pk[kstarts], pt[best_rows].astype(np.int32), pair_count[best_rows].astype(np.int32),
                   total.astype(np.int32))

    def get(self, key: np.uint64) -> tuple[int, int, int] | None:
        i = int(np.searchsorted(self.keys, key))
        if i < len(self.keys) and self.keys[i] == key:
            return int(self.best[i]), int(self.count[i]), int(self.total[i])
        return None

    def __len__(self) -> int:
        return int(self.keys.shape[0])


def _answer_windows(ids: np.ndarray, mask: np.ndarray, max_order: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per order: (hashes, next tokens) of the windows whose next token is an answer token."""
    hashes = _window_hashes(ids, max_order)
    keys, nexts = [np.empty(0, np.uint64)], [np.empty(0, np.int64)]
    for n in range(1, max_order + 1):
        h = hashes[n]
        if len(h) <= 1:
            keys.append(np.empty(0, np.uint64)); nexts.append(np.empty(0, np.int64))  # noqa: E702
            continue
        # window k ends at k + n - 1; its next token is ids[k + n]
        nxt_pos = np.arange(n, len(ids))
        sel = mask[nxt_pos].astype(bool)
        keys.append(h[:-1][sel])
        nexts.append(ids[nxt_pos][sel].astype(np.int64))
    return keys, nexts


class NgramLookup:
    """Backoff n-gram drafts from the target's own answers plus the running sequence, with calibrated acceptance.

    Build with `NgramLookup.build(sequences)` (token ids with their answer masks) or `from_data(folders)` (the
    `dspark-hf data` folders a drafter trains on); `propose(prefix_ids, max_tokens)` drafts one sequence.
    """

    # decoding stops extending a proposal below this prefix survival: worth < 0.01 tokens, such a draft never pays
    # for its verification width, and each draft's search is the cost saved
    negligible_survival = 0.01

    def __init__(self, tables: list[_Table], max_order: int, calibration: np.ndarray,
                 meta: dict | None = None) -> None:
        if max_order < 1 or len(tables) != max_order + 1:
            raise ValueError(f"need one table per order 1..{max_order}, got {len(tables) - 1}")
        expected = (len(_SOURCES), _length_buckets(max_order), _PURITY_BUCKETS, _COUNT_BUCKETS, 2)
        if calibration.shape != expected:
            raise ValueError(f"calibration must have shape {expected}, got {tuple(calibration.shape)}")
        self.tables, self.max_order = tables, int(max_order)
        self.calibration = calibration.astype(np.float64)  # [source, order, purity, count, (hits, trials)]
        self.meta = dict(meta or {})
        self._rates = self._fit_rates()

    # ------------------------------------------------------------------ building
    @classmethod
    def build(cls, sequences: Iterable[tuple[Sequence[int], Sequence[int]]], max_order: int = 8,
              heldout_share: float = 0.05, ids: Sequence[str] | None = None, max_calibration_tokens: int = 30000,
              min_total: int = 1, meta: dict | None = None) -> "NgramLookup":
        """Builds the table from `(input_ids, loss_mask)` pairs (answer tokens have mask 1).

        `heldout_share` of the sequences (chosen by a hash of their `ids`, or of their position when no ids are given)
        calibrate the acceptance estimates against a table built without them; the returned table holds all of them.
        `min_total` drops the windows seen fewer times (a smaller file; 2 drops the n-grams seen once).
        """
        if not 1 <= max_order <= 16:
            raise ValueError(f"max_order must lie in [1, 16], got {max_order}")
        if min_total < 1:
            raise ValueError(f"min_total must be >= 1, got {min_total}")
        if not 0.0 <= heldout_share < 1.0:
            raise ValueError(f"heldout_share must lie in [0, 1), got {heldout_share}")
        seqs = [(np.asarray(a, dtype=np.int64), np.asarray(m, dtype=np.int8)[: len(a)]) for a, m in sequences]
        # (a mask longer than its ids is cut, as training reads it; a shorter one is an error below)
        if not seqs:
            raise ValueError("no sequences to build an n-gram lookup from")
        for a, m in seqs:
            if a.size and int(a.min()) < 0:
                raise ValueError("token ids must be non-negative")
            if len(m) != len(a):
                raise ValueError("a loss_mask must be at least as long as its input_ids")
        names = list(ids) if ids is not None else [str(i) for i in range(len(seqs))]
        if len(names) != len(seqs):
            raise ValueError("ids must name every sequence")
        held = [int(hashlib.md5(n.encode()).hexdigest(), 16) % 10_000 < heldout_share * 10_000 for n in names]
        windows = [_answer_windows(a, m, max_order) for a, m in seqs]
        calibration = np.zeros((len(_SOURCES), _length_buckets(max_order), _PURITY_BUCKETS, _COUNT_BUCKETS, 2))
        if any(held) and not all(held):
            partial = cls(cls._tables(windows, [not h for h in held], max_order, min_total), max_order, calibration)
            budget = max_calibration_tokens
            for (a, m), h in zip(seqs, held):
                if h and budget > 0:
                    budget -= partial._record(a, m, calibration, budget)
        tables = cls._tables(windows, [True] * len(seqs), max_order, min_total)
        info = {"format": _FORMAT, "sequences": len(seqs), "heldout_sequences": int(sum(held)), "min_total": min_total,
                "answer_tokens": int(sum(int(m.sum()) for _, m in seqs)), **(meta or {})}
        return cls(tables, max_order, calibration, info)

    @classmethod
    def from_data(cls, data_dir: str | os.PathLike | Sequence[str | os.PathLike], max_order: int = 8,
                  heldout_share: float = 0.05, min_total: int = 1) -> "NgramLookup":
        """From `dspark-hf data` folders (comma-separated or a list; newer first, as for training)."""
        import importlib

        # (by name, not an import statement: the remote-code copies of this file only draft and must not pull the
        # training modules in)
        try:
            data = importlib.import_module("..training.data", __package__)
        except (ImportError, TypeError) as error:
            raise ImportError("NgramLookup.from_data needs the dspark_hf package (pip install dspark-hf)") from error
        data_folders, read_examples = data.data_folders, data.read_examples

        examples = read_examples(data_dir)
        return cls.build(((e.input_ids, e.loss_mask) for e in examples), max_order=max_order,
                         heldout_share=heldout_share, ids=[e.id for e in examples], min_total=min_total,
                         meta={"data": [str(p) for p in data_folders(data_dir)]})

    @staticmethod
    def _tables(windows: list, use: list[bool], max_order: int, min_total: int = 1) -> list[_Table]:
        tables = [_Table.from_pairs(np.empty(0, np.uint64), np.empty(0, np.int64))]
        for n in range(1, max_order + 1):
            keys = [w[0][n] for w, u in zip(windows, use) if u]
            nexts = [w[1][n] for w, u in zip(windows, use) if u]
            table = _Table.from_pairs(np.concatenate(keys) if keys else np.empty(0, np.uint64),
                                      np.concatenate(nexts) if nexts else np.empty(0, np.int64))
            tables.append(table.pruned(min_total) if min_total > 1 else table)
        return tables

    def _record(self, ids: np.ndarray, mask: np.ndarray, calibration: np.ndarray, budget: int) -> int:
        """Adds one held-out sequence's first-token outcomes per source to `calibration`; returns tokens used."""
        used = 0
        seq = ids.tolist()
        for t in np.flatnonzero(mask):
            if used >= budget:
                break
            if t == 0:  # nothing precedes it
                continue
            prefix = seq[:t]
            for s, cand in enumerate((self._corpus_candidate(prefix), self._context_candidate(prefix))):
                if cand is not None:
                    token, order, best, total = cand
                    cell = calibration[s, order, _purity_bucket(best, total), _count_bucket(total)]
                    cell[0] += token == seq[t]
                    cell[1] += 1
            used += 1
        return used

    def _fit_rates(self) -> np.ndarray:
        """`[source, order, purity, count]` acceptance estimates: bucket rates shrunk toward the bucket's purity."""
        purity_mid = (np.arange(_PURITY_BUCKETS) + 0.5) / _PURITY_BUCKETS
        prior = 0.5 * purity_mid[None, None, :, None]  # an uncalibrated n-gram is trusted at half its purity
        strength = 20.0
        hits, trials = self.calibration[..., 0], self.calibration[..., 1]
        return (hits + strength * prior) / (trials + strength)

    # ------------------------------------------------------------------ lookup
    def _corpus_candidate(self, prefix: Sequence[int], hashes: list[int] | None = None
                          ) -> tuple[int, int, int, int] | None:
        """The corpus table's continuation of the longest suffix of `prefix` it holds: (token, order, best count,
        total). `hashes`: `_suffix_hashes(prefix, max_order)` where the caller has them already."""
        hashes = _suffix_hashes(prefix, self.max_order) if hashes is None else hashes
        for n in range(len(hashes) - 1, 0, -1):
            hit = self.tables[n].get(np.uint64(hashes[n]))
            if hit is not None:
                return hit[0], n, hit[1], hit[2]
        return None

    def _context_candidate(self, prefix: Sequence[int]) -> tuple[int, int, int, int] | None:
        """Longest suffix of `prefix` that occurred earlier in it: its most frequent continuation (ties: the most
        recent), with (order, best count, total)."""
        length = len(prefix)
        if length < 2:
            return None
        arr = np.asarray(prefix, dtype=np.int64)
        hashes = _window_hashes(arr, min(self.max_order, length - 1))
        for n in range(len(hashes) - 1, 0, -1):
            h = hashes[n]
            # windows that end before the last token (so they have a continuation) and equal the suffix
            ends = np.flatnonzero(h[:-1] == h[-1])
            if ends.size == 0:
                continue
            nxt = arr[ends + n]
            values, counts = np.unique(nxt, return_counts=True)
            top = counts.max()
            tied = set(values[counts == top].tolist())
            token = next(int(t) for t in nxt[::-1] if int(t) in tied)  # the most recent of the most frequent
            if n == self.max_order:  # follow the longest occurrence that predicts `token` further back
                n = _match_length(arr, ends[nxt == token], n, self.max_order)
            return token, n, int(top), int(ends.size)
        return None

    def estimate(self, source: int, order: int, best: int, total: int) -> float:
        return float(self._rates[source, order, _purity_bucket(best, total), _count_bucket(total)])

    def context(self, ids: Sequence[int] = ()) -> "LookupContext":
        """A `LookupContext` holding `ids`: pass it to `propose` in place of the sequence, and `extend` it as the
        sequence grows, so each call indexes only the new tokens (the batched loop keeps one per row)."""
        return LookupContext(self.max_order, ids)

    def propose(self, prefix_ids: "Sequence[int] | LookupContext", max_tokens: int,
                min_survival: float = 0.0) -> LookupProposal:
        """Up to `max_tokens` drafts continuing `prefix_ids`, each the better-estimated of the corpus and the context
        candidate; stops where neither source matches, or once the prefix survival falls below `min_survival` (a draft
        that unlikely to be reached never pays for its verification; the search per draft is the cost saved).

        `prefix_ids` may be a `LookupContext` (`context`) holding the sequence: the same proposals (the same hashes and
        statistics, kept incrementally), without re-hashing the whole sequence for every draft. The context is left
        as it was given (the drafts are pushed and popped again)."""
        if isinstance(prefix_ids, LookupContext):
            if prefix_ids.max_order != self.max_order:
                raise ValueError(f"a LookupContext of max_order {prefix_ids.max_order} for a lookup of max_order "
                                 f"{self.max_order}: make it with this lookup's `context()`")
            return self._propose_in(prefix_ids, max_tokens, min_survival)
        seq = [int(t) for t in prefix_ids]
        tokens: list[int] = []
        acceptance: list[float] = []
        sources: list[str] = []
        survival = 1.0
        for _ in range(max(0, int(max_tokens))):
            if survival < min_survival:
                break
            best = self._best(self._corpus_candidate(seq), self._context_candidate(seq))
            if best is None:
                break
            tokens.append(best[1]); acceptance.append(best[0]); sources.append(best[2])  # noqa: E702
            seq.append(best[1])
            survival *= best[0]
        return LookupProposal(tokens, acceptance, sources)

    def _best(self, *candidates: tuple[int, int, int, int] | None) -> tuple[float, int, str] | None:
        """(estimate, token, source) of the better-estimated candidate (corpus first on ties), or None."""
        best: tuple[float, int, str] | None = None
        for s, cand in enumerate(candidates):
            if cand is not None:
                est = self.estimate(s, cand[1], cand[2], cand[3])
                if best is None or est > best[0]:
                    best = (est, cand[0], _SOURCES[s])
        return best

    def _propose_in(self, context: "LookupContext", max_tokens: int, min_survival: float) -> LookupProposal:
        tokens: list[int] = []
        acceptance: list[float] = []
        sources: list[str] = []
        pushed: list[list[int]] = []  # the hashes each draft was pushed with (its pop reuses them)
        survival = 1.0
        try:
            for _ in range(max(0, int(max_tokens))):
                if survival < min_survival:
                    break
                hashes = _suffix_hashes(context.ids, self.max_order)
                best = self._best(self._corpus_candidate(context.ids, hashes), context.candidate(hashes))
                if best is None:
                    break
                tokens.append(best[1]); acceptance.append(best[0]); sources.append(best[2])  # noqa: E702
                context.push(best[1], hashes)
                pushed.append(hashes)
                survival *= best[0]
        finally:
            for hashes in reversed(pushed):
                context.pop(hashes)
        return LookupProposal(tokens, acceptance, sources)

    def calibration_report(self) -> dict:
        """Held-out first-token acceptance per source: trials, hits, and the rate the estimates predict."""
        out = {}
        for s, name in enumerate(_SOURCES):
            cells = self.calibration[s]
            trials, hits = float(cells[..., 1].sum()), float(cells[..., 0].sum())
            predicted = float((self._rates[s] * cells[..., 1]).sum())
            out[name] = {"trials": int(trials), "hits": int(hits), "rate": hits / trials if trials else float("nan"),
                         "predicted": predicted / trials if trials else float("nan")}
        return out

    def __len__(self) -> int:
        return sum(len(t) for t in self.tables)

    @property
    def max_token_id(self) -> int:
        """The largest token id the corpus table can propose (-1 when empty)."""
        return max((int(t.best.max()) for t in self.tables if len(t)), default=-1)

    def check_vocab(self, vocab_size: int) -> None:
        """`ValueError` when this table proposes ids outside a target's vocabulary (a table of another model)."""
        if self.max_token_id >= vocab_size:
            raise ValueError(f"this n-gram lookup proposes token id {self.max_token_id}, outside the target's "
                             f"vocabulary of {vocab_size}: it was built from another model's data")

    # ------------------------------------------------------------------ storage
    def save(self, path: str | os.PathLike) -> None:
        """Writes one safetensors file (atomically: a temporary name in the same folder, then a rename)."""
        from safetensors.numpy import save_file

        tensors = {"calibration": self.calibration.astype(np.float64)}
        for n in range(1, self.max_order + 1):
            t = self.tables[n]
            tensors[f"keys.{n}"] = t.keys.view(np.int64)
            tensors[f"best.{n}"] = t.best.astype(np.int32)
            tensors[f"count.{n}"] = t.count.astype(np.int32)
            tensors[f"total.{n}"] = t.total.astype(np.int32)
        metadata = {"format": _FORMAT, "max_order": str(self.max_order), "meta": json.dumps(self.meta)}
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=metadata)
            make_shareable(tmp)  # (mkstemp creates 0600; the file is data to share, e.g. in a package)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike) -> "NgramLookup":
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no n-gram lookup file at {path} (build one with `dspark-hf lookup`)")
        with safe_open(str(path), framework="numpy") as f:
            metadata = f.metadata() or {}
            if metadata.get("format") != _FORMAT:
                raise ValueError(f"{path} is not an n-gram lookup file ({_FORMAT}); metadata format = "
                                 f"{metadata.get('format')!r}")
            max_order = int(metadata["max_order"])
            tables = [_Table.from_pairs(np.empty(0, np.uint64), np.empty(0, np.int64))]
            for n in range(1, max_order + 1):
                keys = f.get_tensor(f"keys.{n}").view(np.uint64)
                if keys.size > 1 and not bool(np.all(keys[1:] > keys[:-1])):
                    raise ValueError(f"{path}: order-{n} keys are not strictly increasing (corrupt file)")
                tables.append(_Table(keys, f.get_tensor(f"best.{n}"), f.get_tensor(f"count.{n}"),
                                     f.get_tensor(f"total.{n}")))
            calibration = f.get_tensor("calibration")
        return cls(tables, max_order, calibration, json.loads(metadata.get("meta", "{}")))


class LookupContext:
    """The context table of one growing sequence, kept incrementally (`NgramLookup.context`).

    `NgramLookup.propose` on a plain sequence re-hashes every window of the whole sequence for every draft it
    proposes (about 1.4 ms per call on a 300-token sequence, one call per row per round in the batched loop). This
    keeps, per order n, each window hash with the starts of its earlier occurrences that have a continuation, so a
    call costs a few dictionary lookups per draft, and the sequence's new tokens are indexed once (`extend`). Its
    candidates are exactly `NgramLookup._context_candidate`'s: the same hashes, the same longest-suffix, frequency
    and recency rules, the same match length.
    """

    def __init__(self, max_order: int, ids: Sequence[int] = ()) -> None:
        if max_order < 1:
            raise ValueError(f"max_order must be >= 1, got {max_order}")
        self.max_order = int(max_order)
        self.ids: list[int] = []
        self._starts: list[dict[int, list[int]]] = [{} for _ in range(self.max_order + 1)]
        self.extend(ids)

    def __len__(self) -> int:
        return len(self.ids)

    def extend(self, tokens: Iterable[int]) -> None:
        """Appends tokens to the held sequence (indexing each once)."""
        for t in tokens:
            self.push(int(t))

    def push(self, token: int, hashes: list[int] | None = None) -> None:
        """Appends one token: the windows that end just before it now have a continuation. `hashes`: the held
        sequence's `_suffix_hashes` before the push, where the caller has them already."""
        end = len(self.ids)
        hashes = _suffix_hashes(self.ids, self.max_order, end) if hashes is None else hashes
        for n, h in enumerate(hashes[1:], start=1):
            self._starts[n].setdefault(h, []).append(end - n)
        self.ids.append(int(token))

    def pop(self, hashes: list[int] | None = None) -> int:
        """Removes the last token (undoes the last `push`) and returns it. `hashes`: those the push was given."""
        if not self.ids:
            raise IndexError("pop from an empty LookupContext")
        token = self.ids.pop()
        end = len(self.ids)
        hashes = _suffix_hashes(self.ids, self.max_order, end) if hashes is None else hashes
        for n, h in enumerate(hashes[1:], start=1):
            starts = self._starts[n][h]
            starts.pop()
            if not starts:
                del self._starts[n][h]
        return token

    def candidate(self, hashes: list[int] | None = None) -> tuple[int, int, int, int] | None:
        """`NgramLookup._context_candidate` of the held sequence: (token, order, best count, total) or None.
        `hashes`: `_suffix_hashes(self.ids, max_order)` where the caller has them already."""
        ids = self.ids
        length = len(ids)
        if length < 2:
            return None
        hashes = _suffix_hashes(ids, self.max_order) if hashes is None else hashes
        for n in range(min(self.max_order, length - 1), 0, -1):
            starts = self._starts[n].get(hashes[n])
            if not starts:
                continue
            nxt = [ids[k + n] for k in starts]
            counts: dict[int, int] = {}
            for t in nxt:
                counts[t] = counts.get(t, 0) + 1
            top = max(counts.values())
            token = next(t for t in reversed(nxt) if counts[t] == top)  # the most recent of the most frequent
            if n == self.max_order:
                n = _match_length(ids, [k for k, t in zip(starts, nxt) if t == token], n, self.max_order)
            return token, n, top, len(starts)
        return None


def merge_lookup_drafts(block, proposals: Sequence[LookupProposal], do_sample: bool):
    """A drafting round's `DraftBlock` `[R, K]` with each row's drafts replaced by its lookup proposal where that is
    expected to do better (the batched loop's lookup drafts). Returns `(block, used)`, `used` `[R]` bool.

    Which rows switch: greedy, the source with the larger expected number of accepted drafts (sum of prefix survival;
    any rule is lossless there, greedy output does not depend on the drafts). Sampling, a rule that never reads a
    sampled draft token: the lookup's first-draft estimate against the drafter's first confidence c_1, which reads
    the anchor only; a drafter without confidences counts as 0. A switched row carries the lookup tokens (then its
    last one repeated up to K) with point-mass draft distributions and the calibrated estimates as confidences (0
    past the proposal, so no schedule verifies them), so verification and scheduling treat it like any block row.
    """
    import torch

    from .drafting import DraftBlock

    tokens = block.tokens
    rows, width = tokens.shape
    if len(proposals) != rows:
        raise ValueError(f"{len(proposals)} lookup proposals for a block of {rows} rows")
    conf = block.confidences
    drafter_value = (torch.zeros(rows) if conf is None else
                     (conf[:, :1].float() if do_sample else torch.cumprod(conf.float(), 1)).sum(1).cpu())
    used = torch.zeros(rows, dtype=torch.bool)
    new_tokens = tokens.clone()
    new_conf = (torch.zeros(rows, width) if conf is None else conf.float().clone()).to(tokens.device)
    for r, p in enumerate(proposals):
        n = min(len(p.tokens), width)
        if n == 0:
            continue
        value = p.acceptance[0] if do_sample else sum(p.survival[:n])
        if value <= float(drafter_value[r]):
            continue
        used[r] = True
        row = p.tokens[:n] + [p.tokens[n - 1]] * (width - n)
        new_tokens[r] = torch.tensor(row, dtype=tokens.dtype, device=tokens.device)
        new_conf[r] = torch.tensor(p.acceptance[:n] + [0.0] * (width - n), device=tokens.device)
    if not bool(used.any()):
        return block, used
    logits = None
    sparse = block.sparse_logits
    if do_sample:  # exact distributions: point masses on the switched rows
        logits = block.logits.clone()
        idx = used.nonzero().flatten().to(logits.device)
        logits[idx] = float("-inf")
        logits[idx] = logits[idx].scatter(2, new_tokens[idx][..., None].to(logits.device), 0.0)
        sparse = None
    elif sparse is None:
        logits = block.logits  # greedy verification compares tokens only (the logits are never read)
    conf_logits = torch.logit(new_conf.clamp(1e-6, 1 - 1e-6))
    merged = DraftBlock(new_tokens, logits=logits, confidences=new_conf, confidence_logits=conf_logits,
                        sparse_logits=sparse)
    return merged, used


def lookup_block(proposals: Sequence[LookupProposal], width: int, vocab_size: int, device=None):
    """A `DraftBlock` `[R, width]` made of lookup proposals alone (the batched loop's lookup-only rounds, which run
    no drafter): row r carries its proposal's tokens (then its last one repeated up to `width`; a row without a
    proposal carries token 0), point-mass draft distributions (as `SparseLogits`, so nothing vocabulary-sized is
    built) and the calibrated estimates as confidences, 0 past the proposal so that no schedule verifies those slots.
    """
    import torch

    from .drafting import DraftBlock, SparseLogits

    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    rows = len(proposals)
    tokens = torch.zeros(rows, width, dtype=torch.long)
    conf = torch.zeros(rows, width)
    for r, p in enumerate(proposals):
        n = min(len(p.tokens), width)
        if n:
            tokens[r] = torch.tensor(p.tokens[:n] + [p.tokens[n - 1]] * (width - n))
            conf[r, :n] = torch.tensor(p.acceptance[:n])
    tokens, conf = tokens.to(device), conf.to(device)
    sparse = SparseLogits(torch.zeros(rows, width, 1, device=device), tokens[..., None], int(vocab_size))
    return DraftBlock(tokens, confidences=conf, confidence_logits=torch.logit(conf.clamp(1e-6, 1 - 1e-6)),
                      sparse_logits=sparse)
