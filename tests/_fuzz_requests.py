"""Request plans for tests/server/test_fuzz.py: every RadixKV request message, drawn by hypothesis.

Each call's request is one of three kinds:

    wild       every field drawn over its whole type (huge ints, random bytes, token lists
               over the limits or the message size, unknown lease ids, any string), or unset
    coherent   what an engine would send given the state so far: a known lease with its owner,
               its namespace, its matched and allocated block ids, tokens that fit them; on a
               sliding-window server also window parts: asked for in Allocate, and the
               lease's window parts on its last blocks in Insert
    mutated    a coherent request with one field (top level or inside a repeated item)
               replaced by a wild value: the near misses (a foreign lease, a namespace of
               another lease, one block id too many, a repeated id, one token over the vocab)

Messages are built from the proto descriptors, so an RPC added to the service is fuzzed too (wild
and by field names). `learn` records the leases and block ids that answers name, and later
requests draw them again.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from _server import BLOCK_SIZE
from google.protobuf.descriptor import FieldDescriptor as FD
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

from radixkv.v1 import radixkv_pb2 as pb

NUM_BLOCKS = 32
NUM_WINDOWS = 16  # window parts of the sliding-window server (ids NUM_BLOCKS and up)
MAX_TOKENS = 1024
MAX_MESSAGE = 64 << 10
SERVICE = pb.DESCRIPTOR.services_by_name["RadixKV"]
NAMESPACES = ("fuzz-a", "fuzz-b", "fuzz-c")
CLIENTS = ("fuzz-1", "fuzz-2")


# ---- what the answers told ------------------------------------------------------------------


@dataclass
class LeaseInfo:
    owner: str
    namespace: str
    tokens: bytes = b""  # the matched query (its first len(matched) blocks are cached)
    matched: tuple[int, ...] = ()
    allocated: list[int] = field(default_factory=list)
    windows: list[int] = field(default_factory=list)  # window parts allocated (HOLE: none)


@dataclass
class Known:
    """Leases and block ids that answers in this example named."""

    windowed: bool = False  # the server's pool has window parts (sliding window)
    leases: dict[int, LeaseInfo] = field(default_factory=dict)  # live, in the order named
    released: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)  # in the order named

    def add_blocks(self, ids: tuple[int, ...]) -> None:
        self.blocks += [b for b in dict.fromkeys(ids) if b not in self.blocks]


def unpack(data: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(data) // 4}I", data[: len(data) // 4 * 4])


def pack(ids: Any) -> bytes:
    return struct.pack(f"<{len(ids)}I", *ids)


def learn(known: Known, method: str, request: Any, answer: Any) -> None:
    """Record leases and block ids from an OK answer."""
    owner = getattr(request, "client_id", "")
    if method == "Match":
        for q, r in zip(request.queries, answer.results, strict=True):
            known.leases[r.lease_id] = LeaseInfo(owner, q.namespace, q.tokens,
                                                 unpack(r.block_ids),
                                                 list(unpack(r.new_block_ids)),
                                                 list(unpack(r.new_window_ids)))
    elif method == "Allocate":
        ids = unpack(answer.block_ids)
        lease = known.leases.get(answer.lease_id)
        if lease is None:
            lease = known.leases[answer.lease_id] = LeaseInfo(owner, request.namespace)
        lease.allocated += ids
        lease.windows += unpack(answer.window_ids)
    elif method == "Insert":
        for item, r in zip(request.items, answer.results, strict=True):
            lease = known.leases.get(item.lease_id)
            if lease is not None:  # now pins the inserted path; the rest was freed
                used = set(unpack(r.adopted) + unpack(r.duplicates))
                lease.allocated = [b for b in lease.allocated if b not in used]
                lease.windows = [w for w in lease.windows if w not in used]
                lease.tokens, lease.matched = b"", ()
    elif method == "Release":
        for lease_id in dict.fromkeys(request.lease_ids):
            if known.leases.pop(lease_id, None) is not None:
                known.released.append(lease_id)
    _learn_by_name(known, owner, answer)


def _learn_by_name(known: Known, owner: str, answer: Any) -> None:
    """Block ids anywhere in an answer; lease ids of answers to RPCs `learn` does not know."""
    for f, value in answer.ListFields():
        if f.type == FD.TYPE_MESSAGE:
            for sub in (value if f.is_repeated else [value]):
                _learn_by_name(known, owner, sub)
        elif f.type == FD.TYPE_BYTES and ("block" in f.name or "window" in f.name
                                          or f.name == "adopted"):
            known.add_blocks(unpack(value))
        elif (f.name == "lease_id" and value and value not in known.leases
              and value not in known.released):
            known.leases[value] = LeaseInfo(owner, "")


# ---- plans ----------------------------------------------------------------------------------
#
# Hypothesis needs the shape of what a test draws to depend on its choices only, never on the
# server's answers. So a request is drawn as a plan: a function of what is known so far that
# returns {field name: value}, where values may be Refs ("the i-th lease the answers named")
# resolved when the request is sent.

Plan = dict[str, Any]
Make = Callable[[Known], Plan]


@dataclass(frozen=True)
class Ref:
    kind: str  # "lease" or "block"
    index: int


def resolve(value: Any, known: Known) -> Any:
    if isinstance(value, Ref):  # leases: live ones, then released ones
        pool = [*known.leases, *known.released] if value.kind == "lease" else known.blocks
        return pool[value.index % len(pool)] if pool else value.index + 1
    if isinstance(value, tuple) and value and value[0] == "ids":
        return pack([resolve(v, known) for v in value[1]])
    return value


def materialize(desc: Any, plan: Plan, known: Known) -> Any:
    msg = GetMessageClass(desc)()
    for name, value in plan.items():
        f = desc.fields_by_name[name]
        values = value if f.is_repeated else [value]
        if f.type == FD.TYPE_MESSAGE:
            values = [materialize(f.message_type, v, known) for v in values]
        else:
            values = [resolve(v, known) for v in values]
        if f.is_repeated:
            getattr(msg, name).extend(values)
        elif f.type == FD.TYPE_MESSAGE:
            getattr(msg, name).CopyFrom(values[0])
        else:
            setattr(msg, name, values[0])
    return msg


# ---- wild values -----------------------------------------------------------------------------

U32, U64 = (1 << 32) - 1, (1 << 64) - 1
texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
wild_namespaces = st.one_of(st.sampled_from(NAMESPACES), st.just(""), texts,
                            st.integers(250, 300).map(lambda n: "n" * n))  # the 256 limit
wild_client_ids = st.one_of(st.sampled_from(CLIENTS), st.just(""), texts)
wild_tokens = st.one_of(
    st.lists(st.integers(0, 3), max_size=6 * BLOCK_SIZE).map(pack),
    st.binary(max_size=40),  # any length; ids mostly beyond the vocabulary
    st.lists(st.integers(0, U32), max_size=12).map(pack),
    st.integers(MAX_TOKENS - 2, MAX_TOKENS + 2).map(lambda n: pack([1] * n)),  # the token limit
    st.integers(MAX_MESSAGE // 4 - 64, MAX_MESSAGE // 2).map(lambda n: b"\1\0\0\0" * n),
)
indices = st.integers(0, 63)
lease_refs = indices.map(lambda i: Ref("lease", i))
wild_lease_ids = st.one_of(lease_refs, st.just(0), st.integers(0, U64), st.integers(1 << 63, U64))
wild_block_ids = st.one_of(
    st.lists(st.one_of(indices.map(lambda i: Ref("block", i)), st.integers(0, NUM_BLOCKS + 2),
                       st.integers(0, U32)), max_size=8).map(lambda ids: ("ids", ids)),
    st.binary(max_size=13))


def wild_value(f: FD, depth: int) -> st.SearchStrategy[Any]:
    """One (non-repeated) value of field `f`: by name where the name tells what it means, else
    by type over its whole range."""
    name, t = f.name, f.type
    if t == FD.TYPE_MESSAGE:
        return wild_plan(f.message_type, depth + 1)
    if t == FD.TYPE_STRING:
        return {"client_id": wild_client_ids, "namespace": wild_namespaces}.get(name, texts)
    if t == FD.TYPE_BYTES:
        if name == "tokens":
            return wild_tokens
        return wild_block_ids if "block" in name or "window" in name else st.binary(max_size=40)
    if t == FD.TYPE_BOOL:
        return st.booleans()
    if t in (FD.TYPE_UINT64, FD.TYPE_FIXED64):
        return wild_lease_ids if "lease" in name else st.one_of(st.integers(0, 70),
                                                                 st.integers(0, U64))
    if t in (FD.TYPE_UINT32, FD.TYPE_FIXED32):
        return st.one_of(st.integers(0, NUM_BLOCKS + 2), st.integers(0, U32))
    if t in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64):
        return st.integers(-(1 << 63), (1 << 63) - 1)
    if t in (FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32):
        return st.integers(-(1 << 31), (1 << 31) - 1)
    if t in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        return st.floats(allow_nan=False, width=32 if t == FD.TYPE_FLOAT else 64)
    if t == FD.TYPE_ENUM:
        return st.sampled_from([v.number for v in f.enum_type.values])
    raise AssertionError(f"no strategy for field {f.full_name} of type {t}")


def wild_field(f: FD, depth: int) -> st.SearchStrategy[Any]:
    """A value for `f` as a whole: for a repeated field a list of 0-4 drawn values, then up to
    two of them again (repeated ids)."""
    one = wild_value(f, depth)
    if not f.is_repeated:
        return one
    if f.type == FD.TYPE_MESSAGE:
        return st.lists(one, max_size=4)
    return st.tuples(st.lists(one, max_size=4), st.lists(indices, max_size=2)).map(
        lambda t: t[0] + [t[0][i % len(t[0])] for i in t[1]] if t[0] else [])


def wild_plan(desc: Any, depth: int = 0) -> st.SearchStrategy[Plan]:
    """Each field of `desc` wild or (1 in 10) left unset."""

    @st.composite
    def build(draw: Any) -> Plan:
        return {f.name: draw(wild_field(f, depth)) for f in desc.fields
                if depth <= 2 and draw(st.integers(0, 9))}

    return build()


# ---- coherent requests -----------------------------------------------------------------------

# Prompts from 4 fixed blocks (two differ only in their last token): prefixes are shared often.
BLOCKS = ((0, 0, 0, 0), (0, 0, 0, 1), (1, 2, 3, 4), (7, 7, 7, 7))
assert all(len(b) == BLOCK_SIZE for b in BLOCKS)
block_lists = st.lists(st.sampled_from(BLOCKS), max_size=5)
tails = st.lists(st.integers(0, 3), max_size=BLOCK_SIZE - 1)
clients = st.sampled_from(CLIENTS)
spaces = st.sampled_from(NAMESPACES)


def flat(blocks: Any) -> list[int]:
    return [t for b in blocks for t in b]


def coherent_match() -> st.SearchStrategy[Make]:
    queries = st.lists(st.tuples(spaces, block_lists, tails), min_size=1, max_size=3)
    return st.tuples(clients, queries).map(lambda t: lambda known: {
        "client_id": t[0],
        "queries": [{"namespace": ns, "tokens": pack(flat(b) + tail) or pack([5])}
                    for ns, b, tail in t[1]]})


def coherent_allocate() -> st.SearchStrategy[Make]:
    def make(own: bool, i: int, blank: bool, n: int, client: str, ns: str, w: int) -> Make:
        def plan(known: Known) -> Plan:
            ids = list(known.leases)
            windows = {"num_window_blocks": w} if known.windowed else {}
            if own and ids:
                lease_id = ids[i % len(ids)]
                lease = known.leases[lease_id]
                return {"client_id": lease.owner, "lease_id": lease_id, "num_blocks": n,
                        "namespace": "" if blank else lease.namespace, **windows}
            return {"client_id": client, "namespace": ns, "num_blocks": n, **windows}
        return plan

    return st.builds(make, st.booleans(), indices, st.booleans(), st.integers(1, 6), clients,
                     spaces, st.integers(0, 3))


def coherent_insert() -> st.SearchStrategy[Make]:
    """Items for one owner's leases: the matched prefix's tokens and ids, then some of the
    lease's allocated blocks (shuffled) with tokens for them, and maybe a partial tail."""
    items = st.lists(st.tuples(indices, indices, st.randoms(use_true_random=False),
                               block_lists, tails), min_size=1, max_size=2)

    def make(items: list[Any], client: str) -> Make:
        def plan(known: Known) -> Plan:
            usable = [k for k, v in known.leases.items() if v.namespace]
            if not usable:  # nothing to insert into: an unknown lease
                return {"client_id": client, "items": [{
                    "lease_id": 1 + items[0][0], "namespace": NAMESPACES[0],
                    "tokens": pack(BLOCKS[0]), "block_ids": pack([0])}]}
            owner = known.leases[usable[items[0][0] % len(usable)]].owner
            mine = [k for k in usable if known.leases[k].owner == owner]
            out = []
            for i, k, rnd, body, tail in items:
                lease_id = mine[i % len(mine)]
                lease = known.leases[lease_id]
                new = list(lease.allocated)
                rnd.shuffle(new)
                new = new[: k % (len(new) + 1)] if k % 3 == 0 else new  # mostly all of them
                body = (list(body) + [BLOCKS[0]] * len(new))[: len(new)]
                prefix = lease.tokens[: len(lease.matched) * BLOCK_SIZE * 4]
                tokens = prefix + pack(flat(body) + tail)
                item = {"lease_id": lease_id, "namespace": lease.namespace,
                        "tokens": tokens or pack([5]), "block_ids": pack([*lease.matched, *new])}
                if known.windowed and lease.windows:  # on the last blocks, as many as fit
                    wins = lease.windows[-(len(lease.matched) + len(new)):] \
                        if lease.matched or new else []
                    item["window_ids"] = pack(wins[k % 2:] if k % 5 == 0 else wins)
                out.append(item)
            return {"client_id": owner, "items": out}
        return plan

    return st.builds(make, items, clients)


def coherent_release() -> st.SearchStrategy[Make]:
    def make(i: int, js: list[int], client: str) -> Make:
        def plan(known: Known) -> Plan:
            ids = list(known.leases)
            if not ids:
                return {"client_id": client, "lease_ids": [1 + i]}
            owner = known.leases[ids[i % len(ids)]].owner
            mine = [k for k in ids if known.leases[k].owner == owner]
            return {"client_id": owner, "lease_ids": [mine[j % len(mine)] for j in js]}
        return plan

    return st.builds(make, indices, st.lists(indices, min_size=1, max_size=4), clients)


def coherent_by_names(desc: Any) -> st.SearchStrategy[Make]:
    """Any other request (reads, and RPCs added later): fields by name from the fixed sets,
    leases among the known ones, client_id their owner."""
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for f in desc.fields:
        if f.type == FD.TYPE_UINT64 and "lease" in f.name:
            fields[f.name] = st.lists(lease_refs, min_size=1, max_size=3 if f.is_repeated else 1)
        elif f.name == "namespace":
            fields[f.name] = spaces
        elif f.name == "client_id":
            fields[f.name] = clients
        elif f.type in (FD.TYPE_UINT32, FD.TYPE_UINT64):
            fields[f.name] = st.integers(0, 8).map(lambda n, f=f: [n] if f.is_repeated else n)
        elif f.type == FD.TYPE_BOOL:
            fields[f.name] = st.booleans()

    def make(raw: dict[str, Any]) -> Make:
        def plan(known: Known) -> Plan:
            out, owner = {}, None
            for name, value in raw.items():
                f = desc.fields_by_name[name]
                if f.type == FD.TYPE_UINT64 and "lease" in name:
                    ids = [resolve(r, known) for r in value]
                    owner = owner or (known.leases[ids[0]].owner if ids[0] in known.leases
                                      else None)
                    value = ids if f.is_repeated else ids[0]
                out[name] = value
            if owner and "client_id" in out:
                out["client_id"] = owner
            return out
        return plan

    return st.fixed_dictionaries(fields).map(make)


COHERENT = {"Match": coherent_match, "Allocate": coherent_allocate, "Insert": coherent_insert,
            "Release": coherent_release}


def coherent(method: Any) -> st.SearchStrategy[Make]:
    build = COHERENT.get(method.name)
    return build() if build else coherent_by_names(method.input_type)


def mutated(method: Any) -> st.SearchStrategy[Make]:
    """A coherent request with one field, at the top or in one item of a repeated message
    field, replaced by a wild value."""
    desc = method.input_type
    spots: list[tuple[FD | None, FD]] = [(None, f) for f in desc.fields]
    spots += [(f, g) for f in desc.fields if f.type == FD.TYPE_MESSAGE
              for g in f.message_type.fields]
    if not spots:
        return coherent(method)

    @st.composite
    def build(draw: Any) -> Make:
        base = draw(coherent(method))
        parent, f = spots[draw(st.integers(0, len(spots) - 1))]
        value = draw(wild_field(f, 1))
        item = draw(indices)

        def plan(known: Known) -> Plan:
            out = base(known)
            if parent is None:
                out[f.name] = value
            elif parent.name in out:
                holder = out[parent.name]
                holder = holder[item % len(holder)] if parent.is_repeated and holder else holder
                if isinstance(holder, dict):
                    holder[f.name] = value
            return out
        return plan

    return build()


def requests(method: Any) -> st.SearchStrategy[Make]:
    wild = wild_plan(method.input_type).map(lambda plan: lambda known: dict(plan))
    return st.one_of(wild, coherent(method), mutated(method))


# Every method, the request path's three times as often (their state feeds each other).
PATH = ["Match", "Allocate", "Insert", "Release"]
methods = st.sampled_from([m.name for m in SERVICE.methods] + PATH * 2).map(
    SERVICE.methods_by_name.__getitem__)
