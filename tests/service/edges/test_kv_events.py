"""The prompt cache's changes as KV events for llm-d's router (service/edges/kv_events.py): each block published once when
the first row comes to hold it and once when the last lets it go, with its token ids and the chain of hashes; the
frames and payloads read by a decoder written from llm-d's wire schema (three frames; msgpack [timestamp, events,
rank]; positional events), never from our encoder; a late subscriber's replay; a full queue dropping changes and
counting them, never holding up the step."""

import msgpack
import pytest
import zmq

import kvserve.service.edges.kv_events as kv_events_module
from kvserve.service.edges.kv_events import KvEventPublisher
from kvserve.service.core.prompt_cache import BLOCK_TOKENS, PrefixIndex

from ..conftest import collect, serving, stub_of
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


def test_llmds_index_fed_by_two_replicas_events_scores_the_holder_of_the_longest_prefix_highest(tiny_artifact, tmp_path):
    """bench/llmd_index.py (llm-d-router's documented key chain, event handling and LongestPrefix score, written from its
    sources, not from our publisher) reads two serving replicas' events: the replica that served a prompt's start
    scores its blocks, the other what it shares of it, and one that let a prefix go stops scoring it."""
    import sys

    from ...conftest import REPO

    sys.path.insert(0, str(REPO / "bench"))
    from llmd_index import BLOCK, LlmdPrefixIndex

    assert BLOCK == BLOCK_TOKENS
    index = LlmdPrefixIndex("tiny")
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"kv@")
    poller = zmq.Poller()
    poller.register(subscriber, zmq.POLLIN)

    def drain(wait_ms: int) -> int:
        """Every message that comes within wait_ms of the last into index, by the replica its topic names."""
        count = 0
        while poller.poll(wait_ms):
            topic, _, events = read_batch(subscriber.recv_multipart())
            index.apply(topic.split("@")[1], events)
            count += 1
        return count

    def scores_become(expected: dict, prompt: bytes) -> dict:
        """index's scores for prompt once the replicas' messages make them expected (each message read as it comes;
        20 s without them is a failure, shown with the scores reached)."""
        for _ in range(200):
            if index.scores(list(prompt)) == expected:
                break
            drain(100)
        return index.scores(list(prompt))

    def ask(stub, prompt: bytes, new_tokens: int = 1):
        collect(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(prompt)), max_new_tokens=new_tokens, ignore_eos=True))

    replicas = [(f"replica-{i}", f"ipc://{tmp_path}/events-{i}") for i in range(2)]
    with serving(tiny_artifact, max_batch_size=2, kv_events=replicas[0][1], kv_events_topic=f"kv@{replicas[0][0]}@tiny") as first, \
            serving(tiny_artifact, max_batch_size=2, kv_events=replicas[1][1], kv_events_topic=f"kv@{replicas[1][0]}@tiny") as second, \
            stub_of(first) as stub0, stub_of(second) as stub1:
        for (_, endpoint), stub in zip(replicas, (stub0, stub1)):
            subscriber.connect(endpoint)
            for attempt in range(100):  # ZeroMQ's late joiner: a message seen means the subscription is in place
                ask(stub, f"Warm-up {attempt} of the subscription.".encode())
                if drain(300):
                    break
        document = b"In the beginning God created the heaven and the earth. And the earth was without form."  # 5 blocks
        ask(stub1, document + b" Who?")
        question = document + b" What was created?"
        holder = {"replica-1": len(document) // BLOCK}
        assert scores_become(holder, question) == holder
        ask(stub0, document[: 2 * BLOCK] + b" a different ending, long enough for its own block")
        both = {"replica-1": len(document) // BLOCK, "replica-0": 2}
        scores = scores_become(both, question)
        assert scores == both and max(scores, key=scores.get) == "replica-1"
        for n in range(4):  # replica 1's two rows taken by prompts of their own: the document's blocks let go
            ask(stub1, bytes(range(40 + 50 * n, 90 + 50 * n)), new_tokens=2)
        assert scores_become({"replica-0": 2}, question) == {"replica-0": 2}
    subscriber.close(0)
    context.term()


def test_the_llmd_index_hashes_as_its_sources_specify():
    """bench/llmd_index.py's pieces against published vectors: canonical CBOR (RFC 8949, Appendix A) and FNV-1a 64."""
    import sys

    from ...conftest import REPO

    sys.path.insert(0, str(REPO / "bench"))
    from llmd_index import LlmdPrefixIndex, cbor, fnv64a

    for value, encoded in ((0, "00"), (23, "17"), (24, "1818"), (1000, "1903e8"), (1000000, "1a000f4240"),
                           (1000000000000, "1b000000e8d4a51000"), (18446744073709551615, "1bffffffffffffffff"), ("", "60"),
                           ("a", "6161"), ("IETF", "6449455446"), ([], "80"), ([1, 2, 3], "83010203"), (None, "f6"),
                           ([1, [2, 3], [4, 5]], "8301820203820405")):
        assert cbor(value).hex() == encoded, value
    assert [fnv64a(s) for s in (b"", b"a", b"foobar")] == [0xCBF29CE484222325, 0xAF63DC4C8601EC8C, 0x85944171F73967E8]
    index = LlmdPrefixIndex("m")
    keys = index.keys(list(range(40)))  # two whole blocks; the rest is no block
    assert len(keys) == 2 and keys[1] == fnv64a(cbor([keys[0], list(range(16, 32)), None]))
    assert keys[0] == fnv64a(cbor([fnv64a(cbor([fnv64a(b""), None, "m"])), list(range(16)), None]))
