"""Prompt layout: a request as tokenized segments.

Every path (full prefill, prefix reuse, blend, share) sees the same token ids for
the same request, because the layout is built once, segment by segment:

    template prefix | chunk 1 | sep | chunk 2 | sep | ... | body | suffix | reply

Each segment is tokenized on its own, so a context chunk has the same token ids in
every request it appears in (the precondition of chunk reuse). For chat models the
chunks and the body sit inside the last user turn; for base models there is no
template. ``reply`` is an optional start of the assistant's reply (e.g. RULER's answer prefix)
that the generation continues; it follows the generation prompt as its own segment.

User text is text: the special-token strings of the tokenizer (``<|im_start|>``,
``<|im_end|>``, ...) inside a prompt, a chunk, a reply start or any message's content are
tokenized as ordinary characters (:func:`tokenize_text`), so a user cannot open a system turn
or end their own; only the chat template itself produces special tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

SegmentKind = Literal["template", "chunk", "separator", "body", "suffix", "reply"]
SENTINEL = "\u2063SEMKVBODY\u2063"
MESSAGE_SENTINEL = "\u2063SEMKVMSG{}\u2063"
CHUNK_SEPARATOR = "\n\n"


@dataclass
class Segment:
    kind: SegmentKind
    text: str
    token_ids: list[int]


@dataclass
class PromptLayout:
    """A prompt's tokens as segments. ``derived``: what was computed once from the tokens and is kept
    with them (e.g. the prefix block keys, :class:`semkv.reuse.prefix.PrefixKeys`)."""

    segments: list[Segment] = field(default_factory=list)
    derived: dict[object, object] = field(default_factory=dict, compare=False, repr=False)

    @property
    def token_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    def __len__(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)

    def spans(self) -> list[tuple[Segment, int, int]]:
        """(segment, start, end) token offsets of every segment."""
        out, pos = [], 0
        for seg in self.segments:
            out.append((seg, pos, pos + len(seg.token_ids)))
            pos += len(seg.token_ids)
        return out

    def chunk_spans(self) -> list[tuple[Segment, int, int]]:
        return [span for span in self.spans() if span[0].kind == "chunk"]


def _tokenize(tokenizer, text: str) -> list[int]:
    """Template text: its special-token strings become special tokens."""
    return (
        list(tokenizer(text, add_special_tokens=False, split_special_tokens=False)["input_ids"])
        if text
        else []
    )


def separator_ids(tokenizer) -> list[int]:
    """The tokens of :data:`CHUNK_SEPARATOR`, which :func:`build_layout` puts after every chunk."""
    return _tokenize(tokenizer, CHUNK_SEPARATOR)


def tokenize_text(tokenizer, text: str) -> list[int]:
    """User text (a prompt, a chunk, a message): special-token strings in it stay ordinary text.

    For text without such strings the ids are the same as a plain tokenization's."""
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def special_strings(tokenizer) -> list[str]:
    """The texts of the tokenizer's special tokens (what user text must not turn into)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    found = {str(t.content) for t in added.values() if getattr(t, "special", False) and str(t.content)}
    found.update(str(t) for t in getattr(tokenizer, "all_special_tokens", []) if t)
    return sorted(found)


def _template_ids(tokenizer, rendered: str, contents: list[str]) -> list[int]:
    """Token ids of a rendered template in which ``MESSAGE_SENTINEL.format(i)`` stands for
    ``contents[i]``: the template text as template, each content as user text."""
    ids: list[int] = []
    rest = rendered
    for i, content in enumerate(contents):
        marker = MESSAGE_SENTINEL.format(i)
        if rest.count(marker) != 1:
            raise ValueError("the chat template does not render message contents verbatim")
        before, rest = rest.split(marker)
        ids += _tokenize(tokenizer, before) + tokenize_text(tokenizer, content)
    return ids + _tokenize(tokenizer, rest)


def _adds_bos(tokenizer) -> bool:
    """Whether the tokenizer itself puts BOS first (``add_bos_token`` is unreliable: Gemma's reads False)."""
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if bos_id is None:
        return False
    ids = tokenizer("a")["input_ids"]
    return bool(ids) and ids[0] == bos_id


def build_layout(
    tokenizer,
    prompt: str | None = None,
    messages: Sequence[dict[str, str]] | None = None,
    chunks: Sequence[str] = (),
    use_chat_template: bool | None = None,
    assistant_prefix: str = "",
) -> PromptLayout:
    """Lay out a request. Exactly one of ``prompt`` / ``messages`` is given.

    use_chat_template: None = use it when the tokenizer has one.
    assistant_prefix: text the reply starts with, after the generation prompt (tokenized on its own).
    """
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt= or messages=")
    if messages is not None:
        messages = [dict(m) for m in messages]
        if not messages or messages[-1].get("role") != "user":
            raise ValueError("messages must be a non-empty list ending with a user message")
        for m in messages:
            if not isinstance(m.get("content"), str) or m.get("role") not in ("system", "user", "assistant"):
                raise ValueError(
                    f"each message needs role in system/user/assistant and str content; got {m!r}"
                )
        body = messages[-1]["content"]
    else:
        body = prompt
        messages = [{"role": "user", "content": prompt}]
    if not isinstance(body, str):
        raise ValueError(f"prompt must be a str, got {type(body).__name__}")
    chat = bool(getattr(tokenizer, "chat_template", None)) if use_chat_template is None else use_chat_template
    prefix_ids: list[int] | None = None
    if chat:
        messages[-1]["content"] = SENTINEL
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if rendered.count(SENTINEL) != 1:
            raise ValueError("the chat template does not render the user content verbatim")
        prefix_text, suffix_text = rendered.split(SENTINEL)
        earlier = [m["content"] for m in messages[:-1]]
        specials = special_strings(tokenizer)
        if any(token in content for content in earlier for token in specials):
            # An earlier message holds special-token text: render each content as a marker and
            # tokenize the contents as user text (without such text the ids are the plain ones).
            marked = [{**m, "content": MESSAGE_SENTINEL.format(i)} for i, m in enumerate(messages[:-1])]
            marked.append(messages[-1])
            rendered = tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=True)
            prefix_ids = _template_ids(tokenizer, rendered.split(SENTINEL)[0], earlier)
    else:
        bos = getattr(tokenizer, "bos_token", None) if _adds_bos(tokenizer) else None
        prefix_text, suffix_text = (bos or ""), ""
    if prefix_ids is None:
        prefix_ids = _tokenize(tokenizer, prefix_text)
    segments = [Segment("template", prefix_text, prefix_ids)]
    for chunk in chunks:
        if not isinstance(chunk, str):
            raise ValueError(f"chunks must be strings, got {type(chunk).__name__}")
        segments.append(Segment("chunk", chunk, tokenize_text(tokenizer, chunk)))
        segments.append(Segment("separator", CHUNK_SEPARATOR, separator_ids(tokenizer)))
    segments.append(Segment("body", body, tokenize_text(tokenizer, body)))
    segments.append(Segment("suffix", suffix_text, _tokenize(tokenizer, suffix_text)))
    segments.append(Segment("reply", assistant_prefix, tokenize_text(tokenizer, assistant_prefix)))
    return PromptLayout([s for s in segments if s.token_ids or s.kind == "chunk"])
