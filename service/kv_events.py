"""The prompt cache's changes published as KV events, for llm-d's precise prefix-cache routing (`serve --kv-events`).

llm-d's router (llm-d-router, pkg/kvevents) subscribes to every replica's events over ZeroMQ and keeps an index of
which replica holds which prefix, so a request goes to the replica that has its prompt's start cached. It reads vLLM's
wire format, which kvserve writes:

  a message    three frames: the topic (`kv@<replica>@<model>`), the sequence number (8 bytes, big-endian, from 0,
               one a message), the payload
  a payload    msgpack [timestamp (float seconds), [event, ...], data parallel rank (nil)]
  events       ["BlockStored", block_hashes, parent_block_hash (nil for a first block), token_ids, block_size,
               lora_id (nil), medium ("GPU" or "CPU")], ["BlockRemoved", block_hashes, medium], ["AllBlocksCleared"]

A block is prompt_cache.BLOCK_TOKENS ids of a row's tokens; its hash is the prompt cache's own chained key (the router
computes its own keys from the token ids, which every BlockStored carries). A block is stored when the first row comes
to hold it and removed when the last row holding it lets it go (PrefixIndex counts the rows), so two rows sharing a
prefix publish it once.

Publishing never holds up a step: the step thread appends each change to a bounded queue (KV_EVENTS_QUEUE batches; a
change that finds it full is dropped and counted, and its sequence number is skipped, so a subscriber sees the gap),
and a thread of its own sends them. With a replay endpoint (`--kv-events-replay`), a ROUTER socket answers a
subscriber that joins late or missed a message with the last KV_EVENTS_HISTORY messages from the sequence number it
asks for (llm-d's replay protocol: a request of [empty, sequence]; each message back as [empty, topic, sequence,
payload]; then one with an empty payload).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

log = logging.getLogger(__name__)

KV_EVENTS_QUEUE = 10_000  # batches waiting to be sent; past it a change is dropped (and counted)
KV_EVENTS_HISTORY = 10_000  # messages a replay can reach back to
HASH_MASK = 2**64 - 1  # block hashes go out as unsigned 64-bit integers, as the router reads them


class KvEventPublisher:
    """A ZeroMQ PUB socket (and optionally a replay ROUTER socket) fed from a bounded queue by a thread of its own."""

    def __init__(self, endpoint: str, topic: str, block_size: int, medium: str, replay_endpoint: str | None = None):
        """Binds endpoint (and replay_endpoint) now, so a taken port is refused at start."""
        import zmq

        self.topic, self.block_size, self.medium = topic.encode(), block_size, medium
        self.dropped = 0  # changes the full queue turned away
        self.published = 0  # messages sent
        self._next_sequence = 0
        self._queue: queue.Queue = queue.Queue(maxsize=KV_EVENTS_QUEUE)
        self._history: deque = deque(maxlen=KV_EVENTS_HISTORY)  # (sequence, payload) of the last messages sent
        self._context = zmq.Context()
        self._publisher = self._context.socket(zmq.PUB)
        self._publisher.setsockopt(zmq.LINGER, 0)
        self._replay = None
        for name, address in (("events", endpoint), ("replay", replay_endpoint)):
            if not address:
                continue
            try:
                if name == "replay":
                    self._replay = self._context.socket(zmq.ROUTER)
                    self._replay.setsockopt(zmq.LINGER, 0)
                (self._replay if name == "replay" else self._publisher).bind(address)
            except zmq.ZMQError as exc:
                self._close_sockets()
                raise OSError(f"cannot bind {address} for KV {name} ({exc})") from None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._send_loop, name="kvserve-kv-events", daemon=True)
        self._thread.start()

    # --- the step thread's side: what PrefixIndex calls ------------------------------------------------------------

    def stored(self, hashes: list[int], parent: int | None, token_ids: list[int]) -> None:
        """Consecutive blocks a row now holds and no row held before: their hashes, the hash of the block before them
        (None: they start the row), and their ids (len(hashes) * block_size)."""
        self._put(["BlockStored", [h & HASH_MASK for h in hashes], None if parent is None else parent & HASH_MASK, list(token_ids),
                   self.block_size, None, self.medium])

    def removed(self, hashes: list[int]) -> None:
        """Blocks no row holds any more."""
        self._put(["BlockRemoved", [h & HASH_MASK for h in hashes], self.medium])

    def cleared(self) -> None:
        """Every block is gone (the pool's contents are unknown after a failed step)."""
        self._put(["AllBlocksCleared"])

    def _put(self, event: list) -> None:
        sequence = self._next_sequence
        self._next_sequence += 1  # taken even when dropped: the subscriber sees the gap
        try:
            self._queue.put_nowait((sequence, time.time(), event))
        except queue.Full:
            self.dropped += 1

    # --- the sending thread -----------------------------------------------------------------------------------------

    def _send_loop(self) -> None:
        import msgpack
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stopping.is_set():
            try:
                sequence, stamp, event = self._queue.get(timeout=0.01 if self._replay is not None else 0.1)
            except queue.Empty:
                sequence = None
            if sequence is not None:
                payload = msgpack.packb([stamp, [event], None])
                frames = [self.topic, sequence.to_bytes(8, "big"), payload]
                try:
                    self._publisher.send_multipart(frames, flags=zmq.NOBLOCK)  # PUB drops for a subscriber past its high-water mark
                    self.published += 1
                except zmq.ZMQError as exc:
                    log.debug("KV event %d not sent: %s", sequence, exc)
                self._history.append((sequence, payload))
            if self._replay is not None and poller.poll(0):
                self._answer_replay()

    def _answer_replay(self) -> None:
        import zmq

        try:
            frames = self._replay.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            return
        if len(frames) < 2 or len(frames[-1]) != 8:
            return  # not a replay request
        identity, start = frames[0], int.from_bytes(frames[-1], "big")
        last = start
        for sequence, payload in list(self._history):
            if sequence >= start:
                self._replay.send_multipart([identity, b"", self.topic, sequence.to_bytes(8, "big"), payload])
                last = sequence
        self._replay.send_multipart([identity, b"", self.topic, last.to_bytes(8, "big"), b""])  # the end of the replay

    def close(self) -> None:
        """Stop the thread (what is queued is sent first, for at most a second) and close the sockets."""
        deadline = time.monotonic() + 1.0
        while not self._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        self._stopping.set()
        self._thread.join(timeout=2)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for socket in (self._publisher, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._context.term()
