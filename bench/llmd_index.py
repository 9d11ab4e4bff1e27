"""llm-d's prefix index, written from llm-d-router's documented algorithm and fed by nothing but KV events: an
independent reader of kvserve's events (bench/prefix_routing.py routes with it; tests/service/edges/test_kv_events.py holds
two replicas' events to it). Never built from kvserve's own publisher.

- Block keys (pkg/kvcache/kvblock token_processor.go, its default "cbor-fnv" chain): every 16 token ids, a key that is
  FNV-64a of the canonical CBOR of [parent key, tokens, extra] (extra nil for text); the first block's parent is the
  key of [FNV-64a(hash seed), nil, model name].
- Events (pkg/kvevents pool.go, the vLLM adapter): BlockStored maps each of a replica's engine block hashes to the key
  computed from its token ids, chained from its parent's key; BlockRemoved forgets the engine hashes; AllBlocksCleared
  forgets the replica.
- Scoring (pkg/kvcache kvblock_scorer.go, LongestPrefix): per replica, the prompt's blocks it holds counted from the
  first until one is missing.
"""

from __future__ import annotations

import struct
import threading

import msgpack
import zmq

BLOCK = 16  # llm-d's default blockSizeTokens; kvserve's prompt-cache blocks (vllm:cache_config_info block_size)
FNV_OFFSET, FNV_PRIME, MASK = 0xCBF29CE484222325, 0x100000001B3, 2**64 - 1


def fnv64a(data: bytes) -> int:
    value = FNV_OFFSET
    for byte in data:
        value = ((value ^ byte) * FNV_PRIME) & MASK
    return value


def cbor(value) -> bytes:
    """Canonical CBOR (RFC 8949, shortest heads) of what llm-d hashes: unsigned ints, lists of them, text, null."""
    def head(major: int, n: int) -> bytes:
        if n < 24:
            return bytes([major << 5 | n])
        for extra, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
            if n < 1 << (8 * struct.calcsize(fmt)):
                return bytes([major << 5 | extra]) + struct.pack(fmt, n)
        raise ValueError(n)
    if value is None:
        return b"\xf6"
    if isinstance(value, int):
        return head(0, value)
    if isinstance(value, str):
        encoded = value.encode()
        return head(3, len(encoded)) + encoded
    return head(4, len(value)) + b"".join(cbor(item) for item in value)


class LlmdPrefixIndex:
    """llm-d's index of which replica holds which blocks, kept from the replicas' KV events alone."""

    def __init__(self, model: str, hash_seed: str = ""):
        self.root = fnv64a(cbor([fnv64a(hash_seed.encode()), None, model]))
        self.holders: dict[int, set[str]] = {}  # block key -> replicas holding it
        self.engine_keys: dict[tuple[str, int], int] = {}  # (replica, engine block hash) -> block key
        self.unknown_parents = 0  # BlockStored whose parent this index never saw (skipped, as a gap)
        self.lock = threading.Lock()

    def keys(self, tokens: list[int], parent: int | None = None) -> list[int]:
        keys, key = [], self.root if parent is None else parent
        for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
            key = fnv64a(cbor([key, tokens[start:start + BLOCK], None]))
            keys.append(key)
        return keys

    def apply(self, replica: str, events: list) -> None:
        with self.lock:
            for event in events:
                if event[0] == "BlockStored":
                    hashes, parent, tokens = event[1], event[2], event[3]
                    parent_key = None
                    if parent is not None:
                        parent_key = self.engine_keys.get((replica, parent))
                        if parent_key is None:
                            self.unknown_parents += 1
                            continue
                    for engine_hash, key in zip(hashes, self.keys(tokens, parent_key)):
                        self.engine_keys[(replica, engine_hash)] = key
                        self.holders.setdefault(key, set()).add(replica)
                elif event[0] == "BlockRemoved":
                    for engine_hash in event[1]:
                        self.holders.get(self.engine_keys.pop((replica, engine_hash), None), set()).discard(replica)
                elif event[0] == "AllBlocksCleared":
                    for (holder, engine_hash) in [k for k in self.engine_keys if k[0] == replica]:
                        self.holders.get(self.engine_keys.pop((holder, engine_hash)), set()).discard(replica)

    def scores(self, tokens: list[int]) -> dict[str, int]:
        """LongestPrefix: per replica, its blocks of the prompt counted from the first until one is missing."""
        keys = self.keys(tokens)  # hashed outside the lock: the subscriber's thread applies events meanwhile
        if not keys:
            return {}
        with self.lock:
            scores = {replica: 1 for replica in self.holders.get(keys[0], ())}
            active = set(scores)
            for key in keys[1:]:
                active &= self.holders.get(key, set())
                if not active:
                    break
                for replica in active:
                    scores[replica] += 1
            return scores


def subscribe(index: LlmdPrefixIndex, endpoints: dict[str, str], stop: threading.Event) -> threading.Thread:
    """One thread reading every replica's events (topic filter "kv@", as llm-d subscribes) into index."""
    context = zmq.Context.instance()
    sockets = {}
    for replica, endpoint in endpoints.items():
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"kv@")
        socket.connect(endpoint)
        sockets[socket] = replica
    poller = zmq.Poller()
    for socket in sockets:
        poller.register(socket, zmq.POLLIN)

    def run():
        while not stop.is_set():
            for socket, _ in poller.poll(20):
                topic, _sequence, payload = socket.recv_multipart()
                _timestamp, events, _rank = msgpack.unpackb(payload, raw=False)
                index.apply(sockets[socket], events)
        for socket in sockets:
            socket.close(0)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread
