"""Draft tokens: guesses at a row's next tokens that one model step checks all at once (speculation), and when a
row should make them.

A row with drafts d1..dk runs [its last token, d1..dk] through the step's chunk part (batch.py), with logits at every
position; it takes the token it would take at each position without drafts (sequence.Sequence.advance: the argmax, or a
sampled row's draw from its seed, in the same order) until one differs from its draft, so the row gains 1..k+1 tokens
for one step's read of the weights and its tokens are the ones it makes with drafts off. Its columns past what it kept
hold K/V that is never read: a row reads only the positions up to its own, and later tokens overwrite them in order
(kv_rows.py keeps a ring row with such columns out of the prompt cache).

Where drafts come from, per row:
  - the grammar of a constrained row (structured output, tool calls): llguidance's fast-forward tokens, the only
    continuation its bytes allow; each is still checked against the model under its mask (a forced text may be
    tokenized in more than one way, and the model picks among them);
  - prompt lookup: the tokens that followed the latest earlier occurrence of the row's last 3 (or 2) tokens in its own
    prompt and output (copying, quoting, code edits, repeated structure);
  - the output cache (SuffixCache): what followed its last 3 tokens in a recent finished output of any request.

How many (k): each row keeps running estimates of how often its first draft token is taken and how often each later
one is once those before it were (Acceptance), and the step costs (StepCosts, measured from the steps the batch runs,
by decoding rows and drafts, read off a line through the draft counts run) say what a step with k drafts costs against
a plain one; k is the count that gives the step the most tokens per second, within the step-time bound when other rows
wait on it, 0 when none beats no drafts. A row whose drafts keep failing stops drafting for a while (BACKOFF_STEPS).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.contract.config import RING_SLACK

# At most this many drafts a step; a ring row's at most RING_SLACK (most_drafts), whose rejected columns must fall
# outside its window (contract RING_SLACK: a step writes its last token and k drafts; the k-th lands on the ring column
# of the position RING_SLACK + window back).
MAX_DRAFT_TOKENS = 32
NGRAM = 3  # prompt lookup matches the last 3 tokens, then the last 2 (PromptLookup indexes both)
LOOKUP_PRIOR, GRAMMAR_PRIOR = (0.5, 0.7), (0.8, 0.8)  # acceptance (first, then) assumed before a row has drafted
PRIOR_TRIED = 2.0  # the assumed acceptance weighs as much as this many draft tokens tried
ACCEPTANCE_DECAY = 0.7  # each step's counts weigh this much less at the next: a row's text changes as it goes
STOP_BELOW, BACKOFF_STEPS = 0.15, 16  # a row whose first draft tokens are taken less often than this rests so many steps
# A row whose lookup finds nothing this many steps running rests as many, then twice as many each time again, at most
# MAX_REST: text that does not repeat costs its row a lookup now and then, not every step.
MISSES_BEFORE_REST, MAX_REST = 4, 64
DRAFT_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # the k a row may pick
GATE_STEPS = 16  # steps StepCosts.may_pay's answer stands for
OUTLIER = 2.0  # a step timed at more than this many times its running mean counts as this many (a stall, not its cost)
# A draft count not run in this many steps of as many rows is forgotten (looked at every FORGET_EVERY steps): its mean
# stands until it runs again, and one taken in a slow spell, priced out by itself, would stand for good. At 512 and 64,
# a spell of 80 slow steps (each 2.5x) cost the copy workload's next three rounds 40-70 of ~690 drafts taken; at 64
# and 16, 15 in the next round alone (in process, 2-core AMD EPYC Zen 3, by hand).
FORGET_STEPS, FORGET_EVERY = 64, 16
# A chunk cut to keep its step within --step-time-bound still takes this many tokens: a prompt always advances.
MIN_CHUNK_TOKENS = 4
# Chunks of at most this many tokens and chunks of more are timed apart (ChunkCosts): a line through the two says what a
# chunk costs whatever its size (a fixed part) and what each token adds.
SMALL_CHUNK_TOKENS = 2 * MIN_CHUNK_TOKENS


def most_drafts(ring: int | None) -> int:
    """The most drafts a row may check in a step, in a pool whose windowed layers' rows are rings of `ring` columns
    (None: no ring layers)."""
    return MAX_DRAFT_TOKENS if ring is None else min(MAX_DRAFT_TOKENS, RING_SLACK)


class PromptLookup:
    """n-gram index of one row's tokens: for each n-gram (n = 2..NGRAM), where it last ended. A token is appended as it
    comes (push, once a token of every row); its n-grams are indexed only when the row is asked for drafts (propose),
    so a row that is not drafting costs a list append a token."""

    def __init__(self, tokens: list[int]):
        self.tokens: list[int] = list(tokens)
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> the position after its latest occurrence
        self._indexed = NGRAM - 1  # n-grams ending before this position are indexed (with the token that followed them)

    def push(self, token: int) -> None:
        self.tokens.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the row's last n tokens, longest n first. Where
        that occurrence is closer to the end than k tokens, the text is taken to go on repeating from it (a loop, a
        list's rows): the tokens since it, again and again."""
        tokens, end, ends = self.tokens, len(self.tokens), self._ends
        for stop in range(max(self._indexed, 2), end):  # n-grams that now have a continuation
            ends[(tokens[stop - 2], tokens[stop - 1])] = stop
            if stop >= 3:
                ends[(tokens[stop - 3], tokens[stop - 2], tokens[stop - 1])] = stop
        self._indexed = max(self._indexed, end)
        for n in range(NGRAM, 1, -1):
            if end < n:
                continue
            start = ends.get(tuple(tokens[end - n:]))
            if start is not None:
                if start + k <= end:
                    return tokens[start:start + k]
                period = tokens[start:]
                return [period[i % len(period)] for i in range(k)]
        return []


class SuffixCache:
    """Recent finished outputs, across requests, for drafting: each kept with the prompt tokens just before it, and an
    index of their 3-grams (where each last ended), so a row whose last three tokens began an earlier answer drafts
    what followed there (an agent's loop asking again, a retry, a template filled alike). At most `tokens` tokens kept,
    the oldest outputs dropped first; 0 keeps none. The step thread alone uses it."""

    def __init__(self, tokens: int):
        self.capacity = tokens
        self._docs: dict[int, list[int]] = {}  # id -> tokens, oldest first (dicts keep insertion order)
        self._held = 0
        self._next = 0
        self._ends: dict[tuple[int, int, int], tuple[int, int]] = {}  # 3-gram -> (doc id, the position after it)

    def add(self, context: list[int], output: list[int]) -> None:
        """A finished output and the prompt tokens before it (its last NGRAM are kept, so its start can be found)."""
        tokens = context[-NGRAM:] + output
        if not self.capacity or len(tokens) <= NGRAM or len(tokens) > self.capacity:
            return
        while self._held + len(tokens) > self.capacity:
            self._drop(next(iter(self._docs)))
        doc = self._next
        self._next += 1
        self._docs[doc] = tokens
        self._held += len(tokens)
        for end in range(NGRAM, len(tokens)):  # each 3-gram that a token follows
            self._ends[(tokens[end - 3], tokens[end - 2], tokens[end - 1])] = (doc, end)

    def _drop(self, doc: int) -> None:
        tokens = self._docs.pop(doc)
        self._held -= len(tokens)
        for end in range(NGRAM, len(tokens)):
            key = (tokens[end - 3], tokens[end - 2], tokens[end - 1])
            if self._ends.get(key, (None,))[0] == doc:
                del self._ends[key]

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the row's last three tokens in the latest output holding them."""
        if len(tokens) < NGRAM or not self._ends:
            return []
        found = self._ends.get((tokens[-3], tokens[-2], tokens[-1]))
        if found is None:
            return []
        doc, end = found
        return self._docs[doc][end:end + k]

    @property
    def held(self) -> int:
        """Tokens kept."""
        return self._held


class Acceptance:
    """How often a row's drafts are taken, as two running ratios: its first draft token (first), and each later one once
    the ones before it were (then). A copying row's drafts are mostly all taken or refused at the first token
    (the quoting model's copy workload, bench/speculation.py, counted by hand: of 80 drafts of 8, 55 kept whole, 10
    refused at the first token, 15 broken between), so one rate for every position would price a long draft at what its
    first token risks, again and again.

    Each is tokens taken over tokens tried, a step's counts decaying by ACCEPTANCE_DECAY at the next, from a prior worth
    PRIOR_TRIED tokens. A draft's tokens after its first refused one were never tried (the step stops comparing there)
    and count for nothing."""

    __slots__ = ("first_taken", "first_tried", "then_taken", "then_tried")

    def __init__(self, first: float, then: float | None = None):
        then = first if then is None else then
        self.first_taken, self.first_tried = first * PRIOR_TRIED, PRIOR_TRIED
        self.then_taken, self.then_tried = then * PRIOR_TRIED, PRIOR_TRIED

    @property
    def first(self) -> float:
        return self.first_taken / self.first_tried

    @property
    def then(self) -> float:
        return self.then_taken / self.then_tried

    def add(self, offered: int, kept: int) -> None:
        """A step offered `offered` draft tokens and kept the first `kept`."""
        self.first_taken = ACCEPTANCE_DECAY * self.first_taken + (kept > 0)
        self.first_tried = ACCEPTANCE_DECAY * self.first_tried + 1
        if kept and offered > 1:  # its later tokens were tried up to the first refused one
            self.then_taken = ACCEPTANCE_DECAY * self.then_taken + kept - 1
            self.then_tried = ACCEPTANCE_DECAY * self.then_tried + kept - 1 + (kept < offered)

    def expected_tokens(self, k: int) -> float:
        """Tokens a row gains from a step with k drafts: 1 + first * (1 + then + ... + then^(k-1)), summed in closed
        form (asked for every draft count of every candidate row, every step)."""
        then = self.then
        return 1.0 + self.first * (k if then >= 1.0 else (1.0 - then ** k) / (1.0 - then))


@dataclass
class DraftState:
    """One row's drafting: its lookup index, its running acceptance of lookup's and of its grammar's drafts, and its
    rest after failures."""

    lookup: PromptLookup
    acceptance: Acceptance = field(default_factory=lambda: Acceptance(*LOOKUP_PRIOR))
    grammar_acceptance: Acceptance = field(default_factory=lambda: Acceptance(*GRAMMAR_PRIOR))
    resting: int = 0  # steps left before this row drafts again
    misses: int = 0  # steps running its lookup found nothing
    rest: int = MISSES_BEFORE_REST  # steps it rests after its next misses
    drafted: int = 0  # tokens offered to the model
    accepted: int = 0  # of them, kept
    unchecked: tuple[int, int] | None = None  # (position, token): the first of drafts found but not run

    def record(self, offered: int, kept: int, grammar: bool) -> None:
        """A step checked `offered` drafts of this row and kept `kept` (the counts are kept as they happen: the batch
        counts what it offers, Sequence.advance what it keeps, so a Finish made mid-step has them)."""
        if not offered:
            return
        if grammar:
            self.grammar_acceptance.add(offered, kept)
        else:
            self.acceptance.add(offered, kept)
            if self.acceptance.first < STOP_BELOW:
                self.resting = BACKOFF_STEPS  # tried again later, warily
                self.acceptance = Acceptance(LOOKUP_PRIOR[0] / 2, self.acceptance.then)

    def found_unused(self, drafts: list[int]) -> None:
        """Its lookup found drafts that this step does not check (they would not pay, or another row drafts): whether
        the row's next token is the first of them is learnt for free when it comes (check_unused), so a row whose
        acceptance fell too low to draft is not held there by never drafting again."""
        self.unchecked = (len(self.lookup.tokens), drafts[0])

    def check_unused(self) -> None:
        """Count the first unused draft as tried, and taken if the row's next token was it."""
        position, token = self.unchecked
        tokens = self.lookup.tokens
        if len(tokens) > position:
            self.unchecked = None
            self.acceptance.add(1, int(tokens[position] == token))

    def missed(self) -> None:
        """Its lookup found nothing this step (text that does not repeat): after a few such steps it rests, longer each
        time it comes back to nothing."""
        self.misses += 1
        if self.misses >= MISSES_BEFORE_REST:
            self.misses, self.resting, self.rest = 0, self.rest, min(2 * self.rest, MAX_REST)

    def found(self) -> None:
        self.misses, self.rest = 0, MISSES_BEFORE_REST


@dataclass
class ChunkCosts:
    """What a prompt chunk adds to a plain decode step, whatever its size and for each of its tokens: running means of
    the tokens and of the seconds added, one pair for chunks of at most SMALL_CHUNK_TOKENS tokens and one for longer
    chunks, pooled over row counts (on 2 CPU cores a gpt2 chunk token added 0.78 ms whatever the rows beside it), and the
    line through the two pairs. On the CPU its fixed part is ~0: a chunk costs its tokens' compute. On CUDA a step with
    a chunk runs graphs that a decode step's captured replay does not (an H200 step of 16 rows: 0.9 ms decoding, 4.75 ms
    with a chunk, bench/results/h200.md), whose cost a cut chunk pays again at each of its steps. Until both kinds have
    run it is taken as proportional to the tokens. A pair not updated in FORGET_STEPS chunk steps is dropped, so a
    measure taken once (a stall, a load since gone) is taken again."""

    WEIGHT = 0.2
    LINE_SPAN = 4  # mean sizes at least this many tokens apart before a line through them is read
    small: tuple[float, float, int] | None = None  # (mean tokens, mean seconds added, chunk steps when last updated)
    large: tuple[float, float, int] | None = None
    steps: int = 0  # chunk steps recorded

    def record(self, tokens: int, seconds: float) -> None:
        self.steps += 1
        kind = "small" if tokens <= SMALL_CHUNK_TOKENS else "large"
        seen = getattr(self, kind)
        if seen is None or self.steps - seen[2] > FORGET_STEPS:
            setattr(self, kind, (float(tokens), seconds, self.steps))
            return
        mean_tokens, mean_seconds, _ = seen
        fixed, per_token = self.line()
        if fixed + per_token * tokens > 0:  # a stall counts as OUTLIER chunks at most
            seconds = min(seconds, OUTLIER * (fixed + per_token * tokens))
        setattr(self, kind, (mean_tokens + self.WEIGHT * (tokens - mean_tokens), mean_seconds + self.WEIGHT * (seconds - mean_seconds),
                             self.steps))

    def short_chunks(self) -> tuple[float, float] | None:
        """(mean tokens, mean seconds added) of the chunks of at most SMALL_CHUNK_TOKENS run lately; None: none has."""
        pair = self.small
        return None if pair is None or self.steps - pair[2] > FORGET_STEPS else pair[:2]

    def line(self) -> tuple[float, float]:
        """(seconds any chunk adds, seconds each of its tokens adds); (0, 0) before any chunk step is recorded."""
        kept = [pair for pair in (self.small, self.large) if pair is not None and self.steps - pair[2] <= FORGET_STEPS]
        if not kept:
            return 0.0, 0.0
        if len(kept) == 1 or kept[1][0] - kept[0][0] < self.LINE_SPAN:  # one kind run (or two too close): through the origin
            return 0.0, sum(pair[1] for pair in kept) / sum(pair[0] for pair in kept)
        (small_tokens, small_seconds, _), (large_tokens, large_seconds, _) = kept
        per_token = max((large_seconds - small_seconds) / (large_tokens - small_tokens), 0.0)
        fixed = small_seconds - per_token * small_tokens
        if fixed < 0:  # no fixed part: the large chunks' own proportion, which more steps measure
            return 0.0, large_seconds / large_tokens
        return fixed, per_token

    def cut_pays(self, cut: int, allowance: int) -> bool:
        """Whether a chunk of `cut` tokens adds at most half what one of `allowance` does."""
        fixed, per_token = self.line()
        return 2 * (fixed + per_token * cut) <= fixed + per_token * allowance


@dataclass
class StepCosts:
    """What a decode step costs, learnt from the steps run: a running mean of its time (the model call, and the tokens
    taken from it: a sampled row draws at every draft it checks) for each count of decoding rows and of drafts one of
    them checks (0: a plain decode step). A step with drafts runs its row through the
    chunk part of the graph, another path than a plain step's, so its cost is learnt apart: before a (rows, drafts)
    pair has run, it is taken as the plain step's grown by PRIOR_SLOPE a draft (batch 1 on the CPU measures 10-15% a
    token for the first few, bench/speculation.py), and the pair is tried only where that guess says it pays. And what a
    prompt chunk adds to a plain step of as many rows (record_chunk, ChunkCosts), by which the scheduler cuts a chunk to
    keep its step within --step-time-bound (chunk_cut)."""

    PRIOR_SLOPE = 0.1
    WEIGHT = 0.2
    LINE_SPAN = 4  # draft counts at least this far apart before costs are read off a line through them
    seconds: dict[tuple[int, int], float] = field(default_factory=dict)  # (rows, drafts) -> running mean seconds
    _first: set = field(default_factory=set)  # pairs seen once (their first run is not counted)
    _gate: dict = field(default_factory=dict)  # rows -> [may_pay's answer, asks left before it is asked again]
    _lines: dict = field(default_factory=dict)  # rows -> _fit's line through the draft counts' means (dropped as they move)
    _steps: dict = field(default_factory=dict)  # rows -> steps of as many rows recorded
    _ran: dict = field(default_factory=dict)  # (rows, drafts) -> _steps[rows] when it last ran (0: before any was counted)
    chunk_seconds: dict[int, float] = field(default_factory=dict)  # rows -> running mean seconds a prompt chunk token adds
    chunks: ChunkCosts = field(default_factory=ChunkCosts)  # what a chunk adds whatever its size, and a token
    bound: float = 0.0  # the most a step with drafts may cost, as a multiple of a plain one, when other rows wait on it (0: none)

    def record(self, rows: int, drafts: int, seconds: float) -> None:
        key = (rows, drafts)
        step = self._steps[rows] = self._steps.get(rows, 0) + 1
        self._ran[key] = step
        if step % FORGET_EVERY == 0:
            self._forget(rows, step)
        seen = self.seconds.get(key)
        if seen is None:
            if key not in self._first:  # a shape's first run plans its memory (ONNX Runtime): often several times a step
                self._first.add(key)
                return
            expected = self.cost(rows, drafts) if drafts else None
            # A count's first time, timed in a stall, would stand until that count runs again, which the line it
            # steepened then forbids (one of 32 drafts at 6 times its cost made the line's slope 7 times the others'):
            # it counts as OUTLIER times what the counts run so far (or the prior) say at most.
            self.seconds[key] = seconds if expected is None else min(seconds, OUTLIER * expected)
        else:
            self.seconds[key] = seen + self.WEIGHT * (min(seconds, OUTLIER * seen) - seen)  # a stall counts as OUTLIER steps at most
        self._lines.pop(rows, None)

    def _forget(self, rows: int, step: int) -> None:
        """Forget the draft counts of `rows` rows not run in FORGET_STEPS steps: their cost is read off the others'
        line again, or the prior, so where drafts looked too dear to try the scheduler tries them again."""
        stale = [key for key in self.seconds if key[0] == rows and key[1] and step - self._ran.get(key, 0) > FORGET_STEPS]
        for key in stale:
            del self.seconds[key]
        if stale:
            self._lines.pop(rows, None)
            self._gate.pop(rows, None)

    def record_chunk(self, rows: int, tokens: int, seconds: float) -> None:
        """A step of `rows` decoding rows and a prompt chunk of `tokens` took `seconds`: what each chunk token added to a
        plain step of as many rows, and (ChunkCosts) what the chunk added."""
        plain = self.seconds.get((rows, 0))
        if plain is None or tokens <= 0:
            return
        chunk_seconds = max(seconds - plain, 0.0)
        self.chunks.record(tokens, chunk_seconds)
        added = chunk_seconds / tokens
        seen = self.chunk_seconds.get(rows)
        if seen is None:
            self.chunk_seconds[rows] = added
        elif seen > 0:
            self.chunk_seconds[rows] = seen + self.WEIGHT * (min(added, OUTLIER * seen) - seen)
        else:  # measured free (a chunk step timed below the plain mean): OUTLIER times zero would cap it there for good
            self.chunk_seconds[rows] = self.WEIGHT * added

    def chunk_cut(self, rows: int, bound: float, allowance: int) -> int | None:
        """The tokens a prompt chunk beside `rows` decoding rows is cut to, from the `allowance` the step token budget
        gives it (or the rest of its prompt, if shorter), to take at most `bound` times a plain step's time by what a
        chunk token added beside as many rows. That reads a chunk's cost as its tokens', which a short chunk's time
        checks: until one has run lately, a chunk over the bound is cut to MIN_CHUNK_TOKENS to learn it; where short
        chunks alone add more than the bound allows, no cut keeps the bound (a fixed part: a cut chunk pays it at more
        steps), and a chunk is cut to MIN_CHUNK_TOKENS only where so few at least halve what it adds (ChunkCosts.line).
        None: no cut (not measured at this count yet, chunks measured as free, the allowance within the bound or at
        most MIN_CHUNK_TOKENS, or a fixed part dominating what a chunk adds)."""
        plain, added = self.seconds.get((rows, 0)), self.chunk_seconds.get(rows)
        if plain is None or not added:
            return None
        slack = (bound - 1.0) * plain  # what a chunk may add
        fits = int(slack / added + 1e-9)  # floor, not one short of a whole count by rounding
        if fits >= allowance or allowance <= MIN_CHUNK_TOKENS:
            return None
        short = self.chunks.short_chunks()
        if short is None:
            # A cost a token read off long chunks alone would pass a fixed part off as tokens' cost, and a cut to
            # `fits` (a long chunk too, where that part is large: a GPU's 180-token chunk said 12 fit) would keep hiding it.
            return MIN_CHUNK_TOKENS
        if fits >= MIN_CHUNK_TOKENS and short[1] <= slack:
            return fits
        if not self.chunks.cut_pays(MIN_CHUNK_TOKENS, allowance):
            return None
        return MIN_CHUNK_TOKENS

    def cost(self, rows: int, drafts: int) -> float | None:
        """Seconds for a decode step of `rows` rows, one checking `drafts` drafts (None until a plain step of as many rows
        has run). Where draft counts LINE_SPAN or more apart have run, the least-squares line through their running
        means: each mean is a few steps' on a machine whose steps vary by half (bench/speculation.py), and the line,
        which the steps of every count move, does not rank 8 drafts cheaper than 6 as the means themselves can (two
        counts close together would give it a slope of noise)."""
        if drafts:
            line = self._lines.get(rows)
            if line is None:
                line = self._lines[rows] = self._fit(rows)
            if line:
                return line[0] + line[1] * drafts
        known = self.seconds.get((rows, drafts))
        if known is not None:
            return known
        plain = self.seconds.get((rows, 0))
        return None if plain is None else plain * (1 + self.PRIOR_SLOPE * drafts)

    def _fit(self, rows: int) -> tuple[float, float] | tuple[()]:
        """(seconds at 0 drafts, seconds a draft) of the line through the draft counts run with `rows` rows; () where they
        span less than LINE_SPAN. Never falling with more drafts, never below a plain step."""
        points = [(k, seconds) for (r, k), seconds in self.seconds.items() if r == rows and k]
        if len(points) < 2 or max(k for k, _ in points) - min(k for k, _ in points) < self.LINE_SPAN:
            return ()
        mean_k = sum(k for k, _ in points) / len(points)
        mean_s = sum(s for _, s in points) / len(points)
        slope = max(sum((k - mean_k) * (s - mean_s) for k, s in points) / sum((k - mean_k) ** 2 for k, _ in points), 0.0)
        intercept = max(mean_s - slope * mean_k, self.seconds.get((rows, 0), 0.0))
        return intercept, slope

    def may_pay(self, rows: int) -> bool:
        """Whether drafts that are all taken would pay in a step of `rows` rows: asked every step, so answered from what
        it said at most GATE_STEPS asks ago."""
        said = self._gate.get(rows)
        if said is None or said[1] <= 0:
            if (rows, 0) not in self.seconds:  # nothing measured to weigh drafts against yet: asked again next step
                return False
            said = [self.best_count(Acceptance(1.0), rows, MAX_DRAFT_TOKENS) > 0, GATE_STEPS]
            self._gate[rows] = said
        said[1] -= 1
        return said[0]

    def best_count(self, acceptance: Acceptance, rows: int, most: int) -> int:
        """The k (of DRAFT_COUNTS, at most `most`) that makes a step of `rows` decoding rows, one of them drafting k,
        give the most tokens per second; 0 when no k beats drafting none (or no plain step of as many rows has run)."""
        base = self.cost(rows, 0)
        if base is None:
            return 0
        best, best_rate = 0, rows / base
        for k in DRAFT_COUNTS:
            if k > most:
                break
            cost = self.cost(rows, k)
            if self.bound and rows > 1 and cost > self.bound * base:  # the other rows' next token waits on this step
                break
            rate = (rows - 1 + acceptance.expected_tokens(k)) / cost
            if rate > best_rate * 1.02:  # a margin: a 2% gain is within a step's noise
                best, best_rate = k, rate
        return best
