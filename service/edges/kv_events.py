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

Publishing never holds up a step: the step thread notes each change as it is made, and at the end of a step packs
those since the last message into one (at most one each FLUSH_EVERY while steps keep coming; at once when the batch
empties) and hands it to ZeroMQ without waiting, whose own I/O thread (no Python, no GIL) delivers it; a subscriber's queue holds KV_EVENTS_QUEUE
messages, and a change that finds one full is dropped for it, counted, and its sequence number is skipped, so the
subscriber sees the gap. (A Python thread of our own taking changes from a queue cost 5-10% of 16 streams' decode on
2 cores in bench/kv_events.py, from the handoffs of the GIL; a message a change, 2.8% of the step thread's time.) With a replay endpoint (`--kv-events-replay`), a ROUTER socket answers a
subscriber that joins late or missed a message with the last KV_EVENTS_HISTORY messages from the sequence number it
asks for (llm-d's replay protocol: a request of [empty, sequence]; each message back as [empty, topic, sequence,
payload]; then one with an empty payload).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

log = logging.getLogger(__name__)

KV_EVENTS_QUEUE = 10_000  # messages a subscriber's queue holds; past it a change is dropped for it (and counted)
KV_EVENTS_HISTORY = 10_000  # messages a replay can reach back to
HASH_MASK = 2**64 - 1  # block hashes go out as unsigned 64-bit integers, as the router reads them
# The least time between messages while steps keep coming: Python work right after a model step runs on caches the
# weights evicted (~125-170 µs a message then, against 5 µs warm), so busy steps share a message. At 25 ms the step
# thread spent 0.59% of its time publishing under kjv-gpt2's 16 streams, against 1.08% at 10 ms, and a change reached
# the subscriber 28 ms after it was made at p99, inside the router's wait (the 50 ms; bench/kv_events.py).
FLUSH_EVERY = 0.025


class KvEventPublisher:
    """A ZeroMQ XPUB socket the step thread sends on without waiting (and optionally a replay ROUTER socket, answered by
    a thread of its own that sleeps in ZeroMQ until a request comes)."""

    def __init__(self, endpoint: str, topic: str, block_size: int, medium: str, replay_endpoint: str | None = None):
        """Binds endpoint (and replay_endpoint) now, so a taken port is refused at start."""
        import zmq

        self.topic, self.block_size, self.medium = topic.encode(), block_size, medium
        self.dropped = 0  # changes not sent: a subscriber's queue was full
        self.published = 0  # messages sent
        self._next_sequence = 0
        self._pending: list[list] = []  # the changes since the last flush (the step thread's)
        self._last_flush = 0.0
        self._history: deque = deque(maxlen=KV_EVENTS_HISTORY)  # (sequence, payload) of the last messages
        self._context = zmq.Context()
        self._publisher = self._context.socket(zmq.XPUB)
        self._publisher.setsockopt(zmq.LINGER, 0)
        self._publisher.setsockopt(zmq.SNDHWM, KV_EVENTS_QUEUE)
        self._publisher.setsockopt(zmq.XPUB_NODROP, 1)  # a full subscriber queue refuses the message (counted), never blocks
        self._replay = None
        self._thread = None
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
        self._lock = threading.Lock()  # guards the history, which the replay thread reads
        self._stopping = threading.Event()
        if self._replay is not None:
            self._thread = threading.Thread(target=self._replay_loop, name="kvserve-kv-replay", daemon=True)
            self._thread.start()

    # --- the step thread's side: what PrefixIndex calls ------------------------------------------------------------

    def stored(self, hashes: list[int], parent: int | None, token_ids: list[int]) -> None:
        """Consecutive blocks a row now holds and no row held before: their hashes, the hash of the block before them
        (None: they start the row), and their ids (len(hashes) * block_size)."""
        self._pending.append(["BlockStored", [h & HASH_MASK for h in hashes], None if parent is None else parent & HASH_MASK,
                              list(token_ids), self.block_size, None, self.medium])

    def removed(self, hashes: list[int]) -> None:
        """Blocks no row holds any more."""
        self._pending.append(["BlockRemoved", [h & HASH_MASK for h in hashes], self.medium])

    def cleared(self) -> None:
        """Every block is gone (the pool's contents are unknown after a failed step)."""
        self._pending.append(["AllBlocksCleared"])

    def flush(self, now: bool = True) -> None:
        """Send the changes since the last message as one, without waiting: ZeroMQ's I/O thread delivers it (no Python
        thread, no GIL); a subscriber whose queue is full (KV_EVENTS_QUEUE messages) makes it a drop, counted, its
        sequence number skipped. now=False: only once FLUSH_EVERY has passed since the last message (the steps of a busy
        batch share one; the caller flushes now when no step may follow)."""
        if not self._pending or (not now and time.monotonic() - self._last_flush < FLUSH_EVERY):
            return
        self._last_flush = time.monotonic()
        import msgpack
        import zmq

        events, self._pending = self._pending, []
        sequence = self._next_sequence
        self._next_sequence += 1
        payload = msgpack.packb([time.time(), events, None])
        with self._lock:
            self._history.append((sequence, payload))
            try:
                self._publisher.send_multipart([self.topic, sequence.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
                self.published += 1
            except zmq.ZMQError:  # EAGAIN: a subscriber's queue is full
                self.dropped += 1

    # --- replay -------------------------------------------------------------------------------------------------------

    def _replay_loop(self) -> None:
        """The replay socket's own thread (ZeroMQ sockets are one thread's): answers requests until close asks it to stop,
        then closes the socket itself."""
        import zmq

        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        try:
            while not self._stopping.is_set():
                if not poller.poll(100):  # sleeps in ZeroMQ, the GIL released; wakes to see whether to stop
                    continue
                frames = self._replay.recv_multipart()
                if len(frames) < 2 or len(frames[-1]) != 8:
                    continue  # not a replay request
                identity, start = frames[0], int.from_bytes(frames[-1], "big")
                with self._lock:
                    retained = [(sequence, payload) for sequence, payload in self._history if sequence >= start]
                for sequence, payload in retained:
                    self._replay.send_multipart([identity, b"", self.topic, sequence.to_bytes(8, "big"), payload])
                last = retained[-1][0] if retained else start
                self._replay.send_multipart([identity, b"", self.topic, last.to_bytes(8, "big"), b""])  # the end of the replay
        except zmq.ZMQError as exc:
            log.warning("KV events' replay stopped: %s", exc)
        finally:
            self._replay.close(linger=0)

    def close(self) -> None:
        """Stop the replay thread (it closes its socket), then close the publishing socket and the context. Called once
        the steps have stopped (nothing sends any more)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._publisher.close(linger=0)
        self._context.term()

    def _close_sockets(self) -> None:
        for socket in (self._publisher, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._context.term()
