"""The prompt cache's changes as KV events for llm-d's router (service/kv_events.py): each block published once when
the first row comes to hold it and once when the last lets it go, with its token ids and the chain of hashes; the
frames and payloads read by a decoder written from llm-d's wire schema (three frames; msgpack [timestamp, events,
rank]; positional events), never from our encoder; a late subscriber's replay; a full queue dropping changes and
counting them, never holding up the step."""

import msgpack
import pytest
import zmq

import kvserve.service.kv_events as kv_events_module
from kvserve.service.kv_events import KvEventPublisher
from kvserve.service.prompt_cache import BLOCK_TOKENS, PrefixIndex

from .conftest import collect, serving, stub_of
from kvserve.v1 import generation_pb2 as pb


class Recorder:
    def __init__(self):
        self.events = []

    def stored(self, hashes, parent, token_ids):
        self.events.append(("stored", list(hashes), parent, list(token_ids)))

    def removed(self, hashes):
        self.events.append(("removed", list(hashes)))

    def cleared(self):
        self.events.append(("cleared",))


def test_a_block_is_stored_by_its_first_holder_and_removed_by_its_last():
    recorder = Recorder()
    index = PrefixIndex(recorder)
    a = list(range(100, 140))  # 2 whole blocks
    index.put(0, a)
    (kind, hashes, parent, tokens), = recorder.events
    assert kind == "stored" and len(hashes) == 2 and parent is None and tokens == a[: 2 * BLOCK_TOKENS]
    recorder.events.clear()
    b = a[:32] + list(range(500, 516))  # the same 2 blocks, then one of its own
    index.put(1, b)
    assert recorder.events == [("stored", [recorder_last := index._keys[1][2]], hashes[1], b[32:48])]
    recorder.events.clear()
    index.swap(0, 1)  # the same blocks held: nothing to say
    index.remove(0)  # row 0 now holds b: its third block goes, the shared two stay with row 1
    assert recorder.events == [("removed", [recorder_last])]
    recorder.events.clear()
    index.put(1, a + list(range(900, 916)))  # a row extended in place (a sequence that finished): only its new block
    assert [e[0] for e in recorder.events] == ["stored"] and recorder.events[0][2] == hashes[1]
    index.clear()
    assert recorder.events[-1] == ("cleared",)


def read_batch(frames):
    """llm-d's vLLM adapter's schema: [topic, 8-byte big-endian sequence, msgpack [ts, [events], rank]]."""
    assert len(frames) == 3 and len(frames[1]) == 8
    timestamp, events, rank = msgpack.unpackb(frames[2], raw=False)
    assert isinstance(timestamp, float) and rank is None
    return frames[0].decode(), int.from_bytes(frames[1], "big"), events


def receive(socket, count: int, timeout_ms: int = 20_000) -> list:
    """count messages from socket, each within timeout_ms (what the server sends, not a sleep)."""
    got = []
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    while len(got) < count:
        assert poller.poll(timeout_ms), f"{len(got)} of {count} messages came"
        got.append(read_batch(socket.recv_multipart()))
    return got


@pytest.fixture(scope="module")
def published(tiny_artifact, tmp_path_factory):
    directory = tmp_path_factory.mktemp("kv-events")
    events, replay = f"ipc://{directory}/events", f"ipc://{directory}/replay"
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"kv@")
    with serving(tiny_artifact, max_batch_size=2, kv_events=events, kv_events_replay=replay, kv_events_topic="kv@replica-0@tiny") as running, \
            stub_of(running) as stub:
        subscriber.connect(events)
        # A subscription reaches the publisher a moment after connect, and what is sent before it is not for this
        # subscriber (ZeroMQ's late joiner): requests until one message arrives, then every message so far drained.
        poller = zmq.Poller()
        poller.register(subscriber, zmq.POLLIN)
        for attempt in range(100):
            prompt = list(f"Warm-up request {attempt} for the subscription.".encode())
            collect(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=1, ignore_eos=True))
            if poller.poll(500):
                break
        while poller.poll(200):
            subscriber.recv_multipart()
        yield running, stub, subscriber, context, replay
    subscriber.close(0)
    context.term()


def test_a_request_publishes_its_prompts_blocks_with_their_tokens(published):
    running, stub, subscriber, _, _ = published
    prompt = list(b"In the beginning God created the heaven and the earth.")  # 54 ids: 3 whole blocks
    collect(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=2, ignore_eos=True))
    topic, sequence, events = receive(subscriber, 1)[0]
    assert topic == "kv@replica-0@tiny"
    (tag, hashes, parent, token_ids, block_size, lora_id, medium), = events
    assert (tag, parent, block_size, lora_id, medium) == ("BlockStored", None, BLOCK_TOKENS, None, "CPU")
    assert token_ids == prompt[: 3 * BLOCK_TOKENS] and len(hashes) == 3 and all(0 <= h < 2**64 for h in hashes)
    assert running.app.kv_events.dropped == 0


def test_a_late_subscriber_gets_the_history_by_replay(published):
    running, stub, subscriber, context, replay = published
    prompt = list(b"And the earth was without form, and void; and darkness was upon the face")
    collect(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=2, ignore_eos=True))
    live = receive(subscriber, 1)
    dealer = context.socket(zmq.DEALER)
    dealer.connect(replay)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    replayed = []
    poller = zmq.Poller()
    poller.register(dealer, zmq.POLLIN)
    while True:
        assert poller.poll(20_000), "the replay did not end"
        frames = dealer.recv_multipart()[1:]  # the empty delimiter first
        if not frames[2]:
            break
        replayed.append(read_batch(frames))
    dealer.close(0)
    sequences = [s for _, s, _ in replayed]
    assert sequences == list(range(sequences[0], sequences[0] + len(sequences))) and live[0][1] in sequences
    assert replayed[-1][2] == live[0][2]


def test_a_subscriber_that_does_not_read_gets_drops_counted_and_a_gap_never_a_wait(tmp_path, monkeypatch):
    monkeypatch.setattr(kv_events_module, "KV_EVENTS_QUEUE", 1)  # a subscriber's queue: one message (then the socket's buffers)
    publisher = KvEventPublisher(f"ipc://{tmp_path}/e", "kv@x@m", BLOCK_TOKENS, "CPU")
    context = zmq.Context()
    slow = context.socket(zmq.SUB)
    slow.setsockopt(zmq.SUBSCRIBE, b"")
    slow.setsockopt(zmq.RCVHWM, 1)
    slow.connect(f"ipc://{tmp_path}/e")
    tokens = list(range(1000))
    poller = zmq.Poller()
    poller.register(slow, zmq.POLLIN)
    while not poller.poll(10):  # until the subscription has reached the publisher: its first message arrives
        publisher.stored([1], None, tokens)
        publisher.flush()
    for _ in range(20_000):  # never read: the buffers fill, and each flush past them returns at once, counted
        publisher.stored([1], None, tokens)
        publisher.flush()
    assert publisher.dropped > 0 and publisher.published + publisher.dropped == publisher._next_sequence
    received = []
    while poller.poll(200):
        received.append(int.from_bytes(slow.recv_multipart()[1], "big"))
    assert any(b - a > 1 for a, b in zip(received, received[1:])) or received[-1] < publisher._next_sequence - 1  # the gap shows
    slow.close(0)
    context.term()
    publisher.close()


def test_busy_steps_share_a_message_and_an_idle_batch_flushes_at_once(tmp_path):
    publisher = KvEventPublisher(f"ipc://{tmp_path}/e", "kv@x@m", BLOCK_TOKENS, "CPU")
    publisher.removed([1])
    publisher.flush()  # the first: sent
    publisher.removed([2])
    publisher.flush(now=False)  # within FLUSH_EVERY of the last: held for the next
    assert publisher._next_sequence == 1 and len(publisher._pending) == 1
    publisher.removed([3])
    publisher.flush(now=True)  # the batch emptied: both go, as one message
    assert publisher._next_sequence == 2 and not publisher._pending
    assert msgpack.unpackb(publisher._history[-1][1])[1] == [["BlockRemoved", [2], "CPU"], ["BlockRemoved", [3], "CPU"]]
    publisher.close()
