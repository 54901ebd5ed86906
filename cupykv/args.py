"""Argument normalisation at the API edge.

Every count a user passes (a Python int, any numpy integer or a 0-d numpy integer array, never a bool)
becomes a Python int here, before any arithmetic: numpy integers keep their dtype through arithmetic, so
`np.uint64(1)` turns an int64 sum into float64 and `np.int16(200) * 200` wraps. Nothing past the API edge
sees a numpy scalar.
"""
from __future__ import annotations

import itertools
import operator
from typing import List, Mapping, NamedTuple, Optional, Sequence, Tuple, Type

import numpy as np

from .errors import CupykvError, InvalidRequestError, InvalidSpecError, UnknownRequestError


def is_count(value) -> bool:
    """A Python or numpy integer (a 0-d numpy integer array too: numpy returns them), not a bool."""
    if isinstance(value, (int, np.integer)):
        return not isinstance(value, (bool, np.bool_))
    return isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iu"


def is_ordered(value) -> bool:
    """Items in an order of their own: an iterable that is not a str or bytes, a set or a mapping (whose
    order would be theirs, or keys), or a numpy array of other than one dimension. (A dict's keys() and
    items() views keep the dict's order: they count as ordered.)"""
    if isinstance(value, (str, bytes, set, frozenset, Mapping)) or getattr(value, "ndim", 1) != 1:
        return False
    try:
        iter(value)             # (also a sequence with only __getitem__ and __len__)
    except TypeError:
        return False
    return True


def as_count(value, what: str, *, minimum: int = 0, maximum: Optional[int] = None,
             error: Type[CupykvError] = InvalidRequestError) -> int:
    """`value` as a Python int in [minimum, maximum]; otherwise `error` naming `what` and the value.

    what: how the message names the argument, e.g. "num_gen_tokens" or "request 'a': accepted".
    """
    if type(value) is int:          # the common case first: this runs on every call of the hot path
        n = value
    elif not is_count(value):
        raise error(f"{what}={value!r} must be an int (Python or numpy), not {type(value).__name__}")
    else:
        n = int(value)
    if n < minimum or (maximum is not None and n > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise error(f"{what}={value!r} must be {bound}")
    return n


def as_flag(value, what: str, error: Type[CupykvError] = InvalidRequestError) -> bool:
    """`value` as a bool (Python or numpy); anything else is `error` naming `what` (a truthy string such as
    "no" must not switch an option on)."""
    if not isinstance(value, (bool, np.bool_)):
        raise error(f"{what}={value!r} must be a bool")
    return bool(value)


def context_items(contexts) -> list:
    """prepare_batch's contexts (a mapping request id -> chunk tokens, or (id, tokens) pairs) as a list
    of pairs; the counts are checked later, against each request."""
    if type(contexts) is tuple and not contexts:     # the default, in every decode step: no ABC check
        return []
    if isinstance(contexts, Mapping):
        return list(contexts.items())
    if not is_ordered(contexts):
        raise InvalidRequestError(f"contexts={contexts!r}: pass a mapping request id -> chunk tokens, or "
                                  "(request id, tokens) pairs")
    items = []
    for item in contexts:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise InvalidRequestError(f"context entry {item!r} must be (request id, tokens)")
        items.append(tuple(item))
    return items


def request_ids(generation) -> list:
    """prepare_batch's generation list (any iterable of ids, or a numpy array) as a list of its own."""
    if type(generation) is list or type(generation) is tuple:      # before the slower ABC checks
        return list(generation)
    if isinstance(generation, (set, frozenset, Mapping)):       # the batch order would be theirs, or keys
        raise InvalidRequestError(f"generation={generation!r}: a {type(generation).__name__} is not a batch order; "
                                  "pass a list of request ids (num_gen_tokens= gives the tokens of each)")
    if not is_ordered(generation):
        raise InvalidRequestError(f"generation={generation!r}: pass a list of request ids")
    return generation.tolist() if isinstance(generation, np.ndarray) else list(generation)


def accepted_counts(accepted, request_ids: Sequence, scheduled: np.ndarray, num_contexts: int,
                    step_id: int) -> np.ndarray:
    """settle's accepted (None, a mapping id -> tokens, or one count per batch entry) as int64 [num_seqs],
    each in [0, scheduled]; context chunks are accepted whole."""
    if accepted is None:
        return scheduled
    if isinstance(accepted, Mapping):
        index = {rid: i for i, rid in enumerate(request_ids)}
        acc = scheduled.copy()
        for rid, a in accepted.items():
            try:
                i = index[rid]
            except (KeyError, TypeError):
                raise UnknownRequestError(f"request {rid!r} is not in step {step_id}") from None
            acc[i] = as_count(a, f"request {rid!r}: accepted", maximum=int(scheduled[i]))
    elif isinstance(accepted, np.ndarray) and accepted.ndim != 1:
        raise InvalidRequestError(f"accepted: one count per batch entry, got an array of shape {accepted.shape}")
    elif not is_ordered(accepted):
        raise InvalidRequestError(f"accepted={accepted!r}: pass None, a mapping request id -> accepted "
                                  f"tokens, or one count per batch entry (in batch order)")
    else:
        vals = accepted.tolist() if isinstance(accepted, np.ndarray) else list(accepted)
        if len(vals) != len(scheduled):
            raise InvalidRequestError(f"accepted has {len(vals)} entries; step {step_id} has {len(scheduled)}")
        acc = np.array([as_count(a, f"request {rid!r}: accepted", maximum=m)
                        for a, rid, m in zip(vals, request_ids, scheduled.tolist())], np.int64).reshape(-1)
    partial = np.flatnonzero(acc[:num_contexts] != scheduled[:num_contexts])
    if len(partial):
        i = partial[0]
        raise InvalidRequestError(f"request {request_ids[i]!r}: a context chunk is accepted whole "
                                  f"({scheduled[i]} tokens)")
    return acc


def token_ids(tokens, what: str, length: int) -> np.ndarray:
    """Token ids (a sequence or an integer array of `length` ints) as int64 [length]."""
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, (np.ndarray, Sequence)):    # (the ABC last)
        raise InvalidRequestError(f"{what}: needs a sequence of {length} token ids, got {type(tokens).__name__}")
    if isinstance(tokens, np.ndarray):
        arr = tokens
    elif type(tokens) is list and tokens and set(map(type, tokens)) == {int}:
        # plain Python ints (the usual prompt or sampler output): numpy converts them at C speed
        try:
            return _checked_length(np.array(tokens, np.int64), what, length)
        except OverflowError:
            raise InvalidRequestError(f"{what}: token ids must fit in int64") from None
    else:
        arr = np.array(tokens, dtype=object if tokens else np.int64)
    _checked_length(arr, what, length)
    if arr.dtype.kind == "O":
        for t in arr:
            if not is_count(t):
                raise InvalidRequestError(f"{what}: token ids must be ints (got {t!r}, a {type(t).__name__})")
    elif arr.dtype.kind not in "iu":
        raise InvalidRequestError(f"{what}: token ids must be ints (got dtype {arr.dtype})")
    try:
        out = arr.astype(np.int64, casting="safe") if arr.dtype.kind in "iu" and arr.dtype != np.uint64 else None
        if out is None:
            vals = [int(t) for t in arr.tolist()]
            if vals and (min(vals) < -2 ** 63 or max(vals) >= 2 ** 63):
                raise OverflowError
            out = np.array(vals, np.int64)
    except (OverflowError, TypeError):
        raise InvalidRequestError(f"{what}: token ids must fit in int64") from None
    return out


def _checked_length(arr: np.ndarray, what: str, length: int) -> np.ndarray:
    if arr.ndim != 1 or len(arr) != length:
        raise InvalidRequestError(f"{what}: needs {length} token ids, got shape {arr.shape}")
    return arr


def salt_bytes(salt) -> bytes:
    """cache_salt (None, bytes or str) as bytes."""
    if salt is None:
        return b""
    if isinstance(salt, str):
        try:
            return salt.encode("utf-8")
        except UnicodeEncodeError as e:      # a lone surrogate
            raise InvalidRequestError(f"cache_salt={salt!r}: a str salt must encode as UTF-8 ({e.reason} at "
                                      f"{e.start}); pass bytes") from None
    if isinstance(salt, (bytes, bytearray, memoryview)):
        return bytes(salt)
    raise InvalidRequestError(f"cache_salt={salt!r}: must be bytes or str (or None)")


class Reported(NamedTuple):
    """settle's new_tokens, checked: the generation entries that reported their tokens (batch order, no
    repeats), and their tokens concatenated; entry entries[j] has tokens[offsets[j]:offsets[j + 1]]."""
    entries: np.ndarray      # int64 [n]
    offsets: np.ndarray      # int64 [n + 1]
    tokens: np.ndarray       # int64 [offsets[-1]]


def generation_tokens(new_tokens, request_ids: Sequence, accepted: np.ndarray, num_contexts: int,
                      step_id: int) -> Optional[Reported]:
    """settle's new_tokens, checked, as Reported (None: nothing reported). Either a mapping request id ->
    token ids (as many as the entry accepted; generation entries only), or every generation entry's
    accepted tokens in batch order as one integer sequence or array (a sampler's output, no per-request
    containers: the form a large batch should use)."""
    if new_tokens is None:
        return None
    if isinstance(new_tokens, np.ndarray) or not isinstance(new_tokens, Mapping):
        if isinstance(new_tokens, (str, bytes)) or not isinstance(new_tokens, (np.ndarray, Sequence)):
            raise InvalidRequestError(f"new_tokens={new_tokens!r}: pass a mapping request id -> token ids, or "
                                      "the generation entries' accepted tokens in batch order")
        offsets = np.empty(len(accepted) - num_contexts + 1, np.int64)     # (cheaper than concatenating a zero)
        offsets[0] = 0
        accepted[num_contexts:].cumsum(out=offsets[1:])
        tokens = token_ids(new_tokens, f"new_tokens (every generation entry's accepted tokens in batch order, "
                                       f"{len(offsets) - 1} entries)", int(offsets[-1]))
        return Reported(np.arange(num_contexts, len(accepted), dtype=np.int64), offsets, tokens)
    keys = list(new_tokens)
    # The generation entries' own ids, in batch order (a mapping built by walking the batch): a dict lookup
    # would find each at its place (identity, not ==: an equal key of another type need not hash alike).
    gen_ids = request_ids[num_contexts:]
    index = (None if len(keys) == len(gen_ids) and all(map(operator.is_, keys, gen_ids))
             else _batch_positions(request_ids))
    fast = _plain_lists(new_tokens, keys, index, accepted, num_contexts)
    if fast is not None:
        return fast
    if index is None:
        index = _batch_positions(request_ids)
    counts = accepted.tolist()
    entries, lists = [], []
    for rid, toks in new_tokens.items():
        try:
            i = index[rid]
        except (KeyError, TypeError):
            raise UnknownRequestError(f"new_tokens: request {rid!r} is not in step {step_id}") from None
        if i < num_contexts:
            raise InvalidRequestError(f"new_tokens: request {rid!r} has a context chunk in step {step_id}; "
                                      "its tokens are the prompt's (given to add)")
        n = counts[i]
        toks = token_ids(toks, f"new_tokens of request {rid!r} ({n} accepted)", n).tolist()
        entries.append(i)
        lists.append(toks)
    entries = np.array(entries, np.int64)
    entries, offsets, flat = _in_batch_order(entries, lists, accepted[entries])
    return Reported(entries, offsets, np.array(flat, np.int64))


def _batch_positions(request_ids: Sequence) -> dict:
    """The step's request ids -> their batch positions."""
    return dict(zip(request_ids, range(len(request_ids))))


def _plain_lists(new_tokens: Mapping, keys: list, index: Optional[dict], accepted: np.ndarray,
                 num_contexts: int) -> Optional[Reported]:
    """generation_tokens' mapping of the usual kind, with C-speed checks: every key a generation entry's
    request id, every value a list of as many Python ints as the entry accepted, each in int64. keys: the
    mapping's; index: the step's request ids -> batch positions, None when the keys are the generation
    entries' ids in batch order. None for anything else (generation_tokens then checks entry by entry and
    says what is wrong)."""
    lists = list(new_tokens.values())
    if index is None:
        entries = np.arange(num_contexts, num_contexts + len(keys), dtype=np.int64)
    else:
        try:
            entries = np.fromiter(map(index.get, keys, itertools.repeat(-1)), np.int64, len(lists))
        except TypeError:       # an unhashable key
            return None
    if (entries < num_contexts).any() or set(map(type, lists)) != {list}:
        return None
    counts = accepted[entries]
    if list(map(len, lists)) != counts.tolist():
        return None
    entries, offsets, flat = _in_batch_order(entries, lists, counts)
    if not set(map(type, flat)) <= {int}:
        return None
    try:
        return Reported(entries, offsets, np.array(flat, np.int64))
    except OverflowError:
        return None


def _in_batch_order(entries: np.ndarray, lists: List[list], counts: np.ndarray) -> Tuple[np.ndarray, np.ndarray, list]:
    """Distinct generation entries (int64 [n], any order), each one's tokens and how many (int64 [n]) in
    batch order: (entries, offsets int64 [n + 1], the tokens as one list). A mapping built in batch order
    (the usual one) is taken as it is."""
    if len(entries) > 1 and not (entries[1:] > entries[:-1]).all():
        order = np.argsort(entries, kind="stable")
        entries, counts, lists = entries[order], counts[order], [lists[j] for j in order.tolist()]
    offsets = np.zeros(len(entries) + 1, np.int64)
    counts.cumsum(out=offsets[1:])
    return entries, offsets, list(itertools.chain.from_iterable(lists))


STAGING_MODES = ("snapshot", "unsafe")


def manager_options(*, staging, ring_slots, max_ring_slots, staging_timeout_s, max_steps_in_flight,
                    debug_verify_mirror, use_graphs, steady_batch_delta) -> dict:
    """KVCacheManager's keyword options, checked (InvalidSpecError naming the bad one) and normalised."""
    if not isinstance(staging, str) or staging not in STAGING_MODES:
        raise InvalidSpecError(f"staging={staging!r}: must be one of {STAGING_MODES}")
    ring_slots = as_count(ring_slots, "ring_slots", minimum=1, error=InvalidSpecError)
    if (not isinstance(staging_timeout_s, (int, float, np.integer, np.floating)) or isinstance(staging_timeout_s, bool)
            or not staging_timeout_s > 0):
        raise InvalidSpecError(f"staging_timeout_s={staging_timeout_s!r}: must be a positive number of seconds")
    return dict(staging=staging, ring_slots=ring_slots,
                max_ring_slots=as_count(max_ring_slots, "max_ring_slots", minimum=ring_slots, error=InvalidSpecError),
                staging_timeout_s=float(staging_timeout_s),
                max_steps_in_flight=as_count(max_steps_in_flight, "max_steps_in_flight", minimum=1,
                                             error=InvalidSpecError),
                debug_verify_mirror=as_flag(debug_verify_mirror, "debug_verify_mirror", InvalidSpecError),
                use_graphs=as_flag(use_graphs, "use_graphs", InvalidSpecError),
                steady_batch_delta=as_flag(steady_batch_delta, "steady_batch_delta", InvalidSpecError))
