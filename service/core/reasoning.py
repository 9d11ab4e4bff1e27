"""A reasoning model's thinking, told apart from its answer: what vLLM and llama-server return as `reasoning_content`.

Qwen3, DeepSeek-R1 and Phi-4-reasoning think between `<think>` and `</think>` before they answer; their chat
templates say so (thinking_markers reads them from the template). A reply either opens the thinking itself (Qwen3:
`<think>` is its first token) or starts inside it, the template having opened it in the prompt (DeepSeek-R1's
`<think>\\n`); a template told not to think (Qwen3's `enable_thinking: false`) closes it in the prompt, and the reply
is all answer. ThinkingSplit follows one reply's text as it is generated: the thinking goes to `reasoning`, the rest
to the answer, the markers to neither, and text that may begin a marker is held back until it is known not to.

A thinking budget (`thinking_token_budget`, vLLM's name) bounds the tokens a reply may think: once they are spent
the sequence is made to write the closing marker (Sequence.forced), then answers, as llama.cpp's reasoning budget
and vLLM's do.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ThinkingMarkers:
    open: str
    close: str


def thinking_markers(template_source: str | None) -> ThinkingMarkers | None:
    """The markers a chat template's model thinks between, where its template writes both; None for other models."""
    if template_source is not None and OPEN in template_source and CLOSE in template_source:
        return ThinkingMarkers(OPEN, CLOSE)
    return None


def opens_thinking(prompt_text: str, markers: ThinkingMarkers) -> bool:
    """Whether a rendered prompt leaves the reply inside the thinking (its last marker an opening one)."""
    opened, closed = prompt_text.rfind(markers.open), prompt_text.rfind(markers.close)
    return opened > closed


class ThinkingSplit:
    """One reply's text as thinking and answer, step by step (module docstring)."""

    def __init__(self, markers: ThinkingMarkers, thinking: bool, may_open: bool = True):
        """thinking: the prompt left the reply inside the thinking; may_open: the reply may open it itself (not when a
        structure holds the reply from its first token)."""
        self.markers = markers
        self.thinking = thinking
        self._undecided = not thinking and may_open  # the reply's first text decides whether it opens the thinking
        self._held = ""
        self._after_close = False  # the answer's leading blank lines, which follow the closing marker, are left out
        self.thought = thinking  # the reply thought at all

    def split(self, text: str, finishing: bool) -> tuple[str, str]:
        """(thinking, answer) of a step's text; what may begin a marker waits for the next step (or the last)."""
        pending = self._held + text
        self._held = ""
        thinking, answer = "", ""
        while pending:
            if self._undecided:
                stripped = pending.lstrip()
                if not stripped or (self.markers.open.startswith(stripped) and not finishing):
                    self._held = pending  # blank so far, or maybe the opening marker: not known yet
                    return thinking, answer
                self._undecided = False
                if stripped.startswith(self.markers.open):
                    self.thinking = self.thought = True
                    pending = stripped[len(self.markers.open):]
                    continue
            if self.thinking:
                at = pending.find(self.markers.close)
                if at < 0:
                    keep = 0 if finishing else _marker_prefix(pending, self.markers.close)
                    thinking += pending[: len(pending) - keep]
                    self._held = pending[len(pending) - keep:]
                    return thinking, answer
                thinking += pending[:at]
                pending = pending[at + len(self.markers.close):]
                self.thinking, self._after_close = False, True
                continue
            if self._after_close:
                stripped = pending.lstrip("\n")
                if not stripped:
                    return thinking, answer
                self._after_close = False
                pending = stripped
            answer += pending
            pending = ""
        return thinking, answer


def _marker_prefix(text: str, marker: str) -> int:
    """How many of text's last characters may begin marker (held back until the next text tells)."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-k:])), 0)
