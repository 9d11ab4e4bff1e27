"""What the scheduler hands the batch for one step (StepPlan), and what the batch hands back (StepResults): the types
between scheduler.py, which plans (and makes every row move the plan needs), and batch.py, which carries a plan out."""

from __future__ import annotations

from dataclasses import dataclass, field

from .kv_rows import HeldRow
from .sequence import Sequence, StepEvent

StepResults = list[tuple[Sequence, StepEvent | BaseException]]


@dataclass
class StepPlan:
    """What one step runs: decided by the scheduler, carried out by the batch."""

    joining: list[Sequence] = field(default_factory=list)  # admitted now: each took its row as the plan was made
    decode: list[Sequence] = field(default_factory=list)  # rows that decode one token
    chunk: Sequence | None = None  # the row whose prompt advances this step
    chunk_tokens: int = 0  # by this many tokens
    # fresh prompts that prefill whole as consecutive rows of one call beside the decoding rows' (no chunk then):
    # runtime.DecoderRuntime.run_prompts, Scheduler.prompt_group
    prompts: list[Sequence] = field(default_factory=list)
    draft_row: Sequence | None = None  # a row of decode that also checks drafts this step (drafts.py), with no chunk
    drafts: list[int] = field(default_factory=list)  # its guesses at its next tokens
    grammar_drafts: bool = False  # whether they came from its grammar (else from prompt lookup)
    # The pool's rows as this step runs them, joins made (index = row; None: a free row below the last used one).
    slots: list[Sequence | None] = field(default_factory=list)
    held: dict[Sequence, HeldRow] = field(default_factory=dict)  # each of them, its row and the columns it holds there
