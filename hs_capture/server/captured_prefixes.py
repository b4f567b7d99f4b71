"""Per scheduler process, with HSCAP_REUSE_CAPTURED=1: the prompts captured requests were
scheduled with, so that a captured request reuses from the radix cache only a prefix whose
states are in the dump already (the rest of its prompt is prefilled and captured), and so that
a request continuing a captured conversation can be captured too (HSCAP_FOLLOW=1).

Prompts are keyed by chained digests of whole blocks of BLOCK tokens (dump/token_hash.py),
seeded with the request's radix-cache namespace: a request may reuse the longest run of blocks
some other captured request of its namespace holds. A request holds its blocks once it is put
in a prefill batch (ScheduleBatch.prepare_for_extend), up to the end of that chunk, so a
request that waited and was never run holds nothing. A block keeps its first owner (whose
capture holds it, or borrows it in turn); memory is bounded (the least recently added blocks
go first: a forgotten prefix is prefilled again, never borrowed wrongly). Every
tensor-parallel rank's scheduler forms the same batches in the same order, and only forming a
batch changes the index, so every rank's index, and so its prefix matches, agree.
"""

from __future__ import annotations

from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from hs_capture.dump.token_hash import block_chain, digest, token_bytes

BLOCK = 32  # tokens a block: a continued conversation prefills at most BLOCK-1 tokens again
MAX_BLOCKS = 1 << 18  # ~8 M tokens of captured prompts remembered
MAX_ENDS = 1 << 16
# an owner lends its blocks this many times, then lets them go: the next captured request
# with that prefix prefills it again and holds it. A capture that was lost (a step dropped or
# failed) is then lent out a bounded number of times, not for as long as its prefix is in use.
LENDS = 64
MAX_OWNERS = 1 << 16
WALKS = 16  # first blocks (system prompts, per namespace) whose latest walk a request may start from
# `continuing`'s one-block test: a captured prompt's end records its blocks by position up to
# SPARE blocks past where requests part from the recent walk (a system prompt's end), at most
# POSITIONS; with no walk yet, its first UNWALKED blocks. Past RECORDED blocks in all, ends are
# not recorded, and requests that start as they do are judged in full while they are held.
SPARE = 2
POSITIONS = 1024
UNWALKED = 64
RECORDED = 1 << 19


@dataclass
class Prompt:
    """One request's prompt as the index sees it."""
    data: bytes  # token_bytes of the prompt
    chain: List[bytes]  # chained digests of its whole blocks, seeded with its cache namespace
    seed: bytes = b""  # the digest of its cache namespace (SGLang's extra_key, a LoRA's id in it, cache_salt)

    @property
    def tokens(self) -> int:
        return len(self.data) // 8


def namespace_seed(namespace: Any) -> bytes:
    """The digest every chain of prompts in this radix-cache namespace starts from: a prefix is
    only ever reused from a request whose cache it could have come from."""
    return digest(repr(namespace).encode("utf-8", "surrogatepass"))


class CapturedPrefixes:
    def __init__(self, block: int = BLOCK, max_blocks: int = MAX_BLOCKS, max_ends: int = MAX_ENDS) -> None:
        self.block = block
        self.max_blocks = max_blocks
        self.max_ends = max_ends
        # block digest -> the first captured request scheduled with it (least recently added
        # first); None once that request let it go (lend): not held, but still a block of a
        # captured prompt, which `continuing` walks through
        self._owner: "OrderedDict[bytes, Optional[str]]" = OrderedDict()
        # a captured prompt's end: its last whole block's digest (the seed for none) -> tail
        # length -> digests of the whole prompt (the block chain carried over the tail)
        self._ends: "OrderedDict[bytes, Dict[int, Set[bytes]]]" = OrderedDict()
        self.lends = LENDS
        # owner -> [its blocks, times lent] (the most recent owners)
        self._owned: "OrderedDict[str, list]" = OrderedDict()
        # the latest walk of `continuing` that began with a given block in a given namespace:
        # (namespace seed, the first block's token bytes) -> [its token bytes, their block digests,
        # how many of its blocks the latest request that started from it shared]
        self._walks: "OrderedDict[Tuple[bytes, bytes], list]" = OrderedDict()
        # what `continuing` tests one block of a request against before it judges in full: of
        # every captured prompt's end in _ends, its first whole blocks by position (hashes of
        # (namespace seed, first block, position, block) -> how many ends have it), and per (seed,
        # first block) how many blocks those ends recorded; ends shorter than a block per seed
        self._blocks: Dict[int, int] = {}
        self._heads: Dict[Tuple[bytes, bytes], _Reach] = {}
        self._tiny: Counter = Counter()
        self._recorded: Dict[bytes, tuple] = {}  # an _ends key -> what its ends added above

    def prompt(self, tokens: Sequence[int], namespace: Any = None) -> Prompt:
        data, seed = token_bytes(tokens), namespace_seed(namespace)
        return Prompt(data, block_chain(data, self.block, seed), seed)

    def limit(self, p: Prompt, rid: Optional[str]) -> Tuple[int, Optional[str]]:
        """(how many of p's first tokens other captured requests hold, the request holding the
        last of them). Reads only: every tensor-parallel rank asks this as often as its
        scheduler does, and the answer must not depend on how often that was."""
        held, owner = 0, None
        for k, h in enumerate(p.chain):
            o = self._owner.get(h)
            if o is None or o == rid:  # a request never borrows from itself (a re-sent rid)
                break
            held, owner = (k + 1) * self.block, o
        return held, owner

    def add(self, p: Prompt, rid: str, upto: Optional[int] = None) -> None:
        """A captured request was put in a prefill batch, computing its prompt up to `upto`
        (the end of this chunk; None: all of it): those blocks are held from now on, and the
        prompt's end once it is reached."""
        n = p.tokens if upto is None else min(upto, p.tokens)
        for h in p.chain[:n // self.block]:
            if self._owner.get(h) is None:
                self._owner[h] = rid
                self._owned.setdefault(rid, [[], 0])[0].append(h)
                self._owned.move_to_end(rid)
            self._owner.move_to_end(h)
        while len(self._owned) > MAX_OWNERS:
            self._owned.popitem(last=False)
        while len(self._owner) > self.max_blocks:
            self._owner.popitem(last=False)
        if n < p.tokens:
            return
        k = len(p.chain)
        key = p.chain[-1] if k else p.seed
        tails = self._ends.setdefault(key, {})
        self._ends.move_to_end(key)
        tail = p.data[k * self.block * 8:]
        tails.setdefault(len(tail) // 8, set()).add(digest(tail, key))
        if key not in self._recorded:  # every end under a key shares its whole blocks: one record
            self._record_end(key, p)
        while len(self._ends) > self.max_ends:
            self._forget_ends(self._ends.popitem(last=False)[0])

    def _record_end(self, key: bytes, p: Prompt) -> None:
        step, k = self.block * 8, len(p.chain)
        if not k:
            self._tiny[p.seed] += 1
            self._recorded[key] = (p.seed, None, 0, None)
            return
        first = p.data[:step]
        walk = self._walks.get((p.seed, first))
        reach = min(k, UNWALKED)
        if walk is not None:  # past where requests part from the walk, or where this prompt does
            wchain, m, d = walk[1], min(len(walk[1]), k), 0
            while d < m and wchain[d] == p.chain[d]:
                d += 1
            reach = min(k, max(walk[2], d) + SPARE)
        reach = min(reach, POSITIONS)
        if len(self._blocks) >= RECORDED:
            reach = 0  # not recorded: requests that start alike are judged in full while it is held
        self._heads.setdefault((p.seed, first), _Reach()).add(reach)
        keys = array("q", (hash((p.seed, first, j, p.data[j * step:(j + 1) * step])) for j in range(1, reach)))
        for h in keys:
            self._blocks[h] = self._blocks.get(h, 0) + 1
        self._recorded[key] = (p.seed, first, reach, keys)

    def _forget_ends(self, key: bytes) -> None:
        record = self._recorded.pop(key, None)
        if record is None:
            return
        seed, first, reach, keys = record
        if first is None:
            self._tiny[seed] -= 1
            if not self._tiny[seed]:
                del self._tiny[seed]
        else:
            for h in keys:
                left = self._blocks[h] - 1
                if left:
                    self._blocks[h] = left
                else:
                    del self._blocks[h]
            if self._heads[(seed, first)].remove(reach):
                del self._heads[(seed, first)]

    def lend(self, owner: str) -> None:
        """A captured request was put in a batch with a prefix borrowed from `owner`'s blocks."""
        entry = self._owned.get(owner)
        if entry is None:
            return
        entry[1] += 1
        if entry[1] >= self.lends:
            del self._owned[owner]
            for h in entry[0]:
                if self._owner.get(h) == owner:
                    self._owner[h] = None

    def continuing(self, tokens: Sequence[int], namespace: Any = None) -> Optional[Prompt]:
        """The prompt of a request that continues a captured one (else None), its digests
        taken only as far as the index holds blocks when it does not. Most requests of a
        production server are not captured, and this runs for every one of them in the
        scheduler's thread (benchmarks/capture_policy.py times it): the digests of a prefix
        that a recent request shared (a system prompt) are taken from that request's walk,
        and the ids are converted only as far as they are looked at."""
        b, step, seed = self.block, self.block * 8, namespace_seed(namespace)
        ids = _TokenBytes(tokens)
        if self._differs(ids, seed):
            return None
        n, whole = len(tokens), len(tokens) // b
        chain = self._walked(ids, seed)
        known, k = len(chain), 0
        while k < len(chain) and chain[k] in self._owner:
            k += 1
        if k < len(chain):
            del chain[k + 1:]
        else:
            h = chain[-1] if chain else seed
            while k < whole:
                h = digest(ids.upto((k + 1) * b)[k * step:(k + 1) * step], h)
                chain.append(h)
                if h not in self._owner:  # a captured prompt it continues would hold every block before its end
                    break
                k += 1
            if k > known:  # k blocks held: the next request with this prefix starts from them
                self._remember(seed, ids.upto(k * b)[:k * step], chain[:k])
        # up to the first block no captured prompt holds (the whole prompt where there is none):
        # a captured prompt it continues ends inside that block at the latest
        upto = len(chain) * b if chain and chain[-1] not in self._owner else n
        if not self.extends(Prompt(ids.upto(upto)[:upto * 8], chain, seed), n):
            return None
        data = ids.upto(n)
        return Prompt(data, chain + block_chain(data[len(chain) * step:], b, chain[-1] if chain else seed), seed)

    def _differs(self, ids: "_TokenBytes", seed: bytes) -> bool:
        """True where one block of the request shows that it continues no captured prompt (then
        `continuing` would find none either); False: judge it in full. The block tested is the
        one where the request before parted from the recent walk (past a shared system prompt),
        within the blocks every captured prompt's end that starts as this request does recorded
        (each records up to its own end at most): a prompt the request continued would have
        that very block at that position."""
        b = self.block
        whole = len(ids.tokens) // b
        if self._tiny.get(seed):  # a captured prompt shorter than a block: judged in full
            return False
        if not whole:
            return True
        first = ids.upto(b)[:b * 8]
        reach = self._heads.get((seed, first))
        if reach is None:  # no captured prompt ends that starts with this block
            return True
        walk = self._walks.get((seed, first))
        j = min(walk[2] if walk is not None else 1, reach.least - 1, whole - 1)
        if j < 1:
            return False
        block = token_bytes(ids.tokens[j * b:(j + 1) * b])
        return hash((seed, first, j, block)) not in self._blocks

    def _walked(self, ids: "_TokenBytes", seed: bytes) -> List[bytes]:
        """The digests of the longest run of whole blocks that these ids share with the recent
        walk that began with the same block in the same namespace (a copy: the caller extends it).
        The ids are compared first where the request before parted from that walk (a system
        prompt's end), then one block past it: most requests are converted only that far."""
        b, step = self.block, self.block * 8
        most = len(ids.tokens) // b
        walk = self._walks.get((seed, ids.upto(b)[:step])) if most else None
        if walk is None:
            return []
        wdata, wchain, fork = walk
        top, wv = min(len(wchain), most), memoryview(wdata)

        def agree(m: int) -> bool:  # the first m blocks are the walk's
            return ids.upto(m * b).startswith(wv[:m * step])

        lo = min(fork, top)  # the first block agrees (the key)
        if agree(lo):
            hi, ahead = top, 1
            while lo < hi:  # gallop past it: one block, two, four, ...
                t = min(lo + ahead, hi)
                if not agree(t):
                    hi = t - 1
                    break
                lo, ahead = t, 2 * ahead
        else:
            lo, hi = 1, lo - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if agree(mid):
                lo = mid
            else:
                hi = mid - 1
        walk[2] = lo
        return wchain[:lo]

    def _remember(self, seed: bytes, data: bytes, chain: List[bytes]) -> None:
        key = (seed, data[:self.block * 8])
        self._walks[key] = [data, chain, len(chain)]
        self._walks.move_to_end(key)
        while len(self._walks) > WALKS:
            self._walks.popitem(last=False)

    def extends(self, p: Prompt, length: Optional[int] = None) -> bool:
        """Whether p continues a captured prompt: begins with the whole of it and is longer
        (the next turn of a captured conversation). length: the whole prompt's, where p holds
        only its start."""
        n = p.tokens if length is None else length
        for k in range(len(p.chain), -1, -1):
            key = p.chain[k - 1] if k else p.seed
            tails = self._ends.get(key)
            if not tails:
                continue
            start = k * self.block
            for m, digests in tails.items():
                if start + m < n and digest(p.data[start * 8:(start + m) * 8], key) in digests:
                    return True
        return False


class _Reach:
    """How many blocks each captured prompt's end that starts alike recorded, and the least."""

    __slots__ = ("count", "least")

    def __init__(self) -> None:
        self.count: Counter = Counter()
        self.least = 1 << 62

    def add(self, k: int) -> None:
        self.count[k] += 1
        self.least = min(self.least, k)

    def remove(self, k: int) -> bool:
        """True once none is left."""
        self.count[k] -= 1
        if not self.count[k]:
            del self.count[k]
            if not self.count:
                return True
            if k == self.least:
                self.least = min(self.count)
        return False


AHEAD = 128  # ids _TokenBytes converts past what is asked, once it has converted some


class _TokenBytes:
    """A prompt's ids as token_bytes, converted as far as asked: the first time exactly, then
    up to AHEAD more (a walk block by block converts in few calls)."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = tokens
        self.data = b""

    def upto(self, n: int) -> bytes:
        """The bytes of at least the first n ids (all of them, where there are fewer)."""
        have = len(self.data) // 8
        if have < n and have < len(self.tokens):
            end = n if not have else max(n, min(2 * have, n + AHEAD))
            self.data += token_bytes(self.tokens[have:min(len(self.tokens), end)])
        return self.data
