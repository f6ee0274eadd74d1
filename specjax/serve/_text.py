"""Text in and out: the plain chat template, and detokenizing a stream of ids."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

# The chat template of models whose tokenizer has none (the bundled code models): a line per message,
# "role: content", then "assistant:" for the reply.
PLAIN_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                       "{% if add_generation_prompt %}assistant:{% endif %}")


class Detokenizer:
    """Text of a growing list of ids, emitted as it becomes final (held back while it ends inside a character whose
    bytes have not all come); what it emits joins to tokenizer.decode(ids, skip_special_tokens=True).

    A fast tokenizer streams through `tokenizers`' DecodeStream, a constant cost a token, where decoding the whole
    prefix again at each visit costs the output's length (docs/performance.md measures both). A visit's ids go to
    the stream in one call but for the last few, stepped one by one: the text up to a character cut at the chunk's
    end comes out at once, as stepping each id would give it, for a fraction of the calls. A tokenizer without a
    Rust backend, or whose decode adds a clean-up pass (clean_up_tokenization_spaces), which the stream does not
    apply, decodes the prefix."""

    # The ids stepped one by one at a chunk's end: a character is at most 4 bytes, so a chunk stepped whole up to
    # here and cut inside a character is completed, and emitted, by the steps of these.
    TAIL = 3
    steps_lists = True  # whether DecodeStream.step takes a list of ids (recent tokenizers); found at the first call

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.sent = tokenizer, [], ""
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        streams = self.backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self.stream = DecodeStream(skip_special_tokens=True) if streams else None
        self.held = False  # the stream's last step held its ids back (they end inside a character)

    def add(self, ids: list[int], final: bool = False) -> str:
        self.ids += ids
        if self.stream is not None:
            pieces = self._step(ids[:-self.TAIL]) + [self.stream.step(self.backend, i) for i in ids[-self.TAIL:]]
            if pieces:
                self.held = pieces[-1] is None
            new = "".join(piece for piece in pieces if piece)
            if final and self.held:  # a character whose bytes never all came, as decode renders it
                text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
                new += text[len(self.sent) + len(new):] if text.startswith(self.sent + new) else ""
            self.sent += new
            return new
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not final:  # all but a character cut at the end
            text = text.rstrip("\ufffd")
        new, self.sent = text[len(self.sent):], text
        return new

    def _step(self, ids: list[int]) -> list[str | None]:
        if not ids:
            return []
        if Detokenizer.steps_lists:
            try:
                return [self.stream.step(self.backend, ids)]
            except TypeError:  # an older tokenizers: one id a call
                Detokenizer.steps_lists = False
        return [self.stream.step(self.backend, i) for i in ids]
