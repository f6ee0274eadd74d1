"""Text in and out: the plain chat template, and detokenizing a stream of ids."""

from __future__ import annotations

import functools

from tokenizers.decoders import DecodeStream

# The chat template of models whose tokenizer has none (the bundled code models): a line per message,
# "role: content", then "assistant:" for the reply.
PLAIN_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                       "{% if add_generation_prompt %}assistant:{% endif %}")


class Detokenizer:
    """Text of a growing list of ids, emitted as it becomes final (held back while it ends inside a character whose
    bytes have not all come); what it emits joins to tokenizer.decode(ids, skip_special_tokens=True).

    A fast tokenizer streams through `tokenizers`' DecodeStream, a constant cost a token, where decoding the whole
    prefix again at each visit costs the output's length (docs/performance.md measures both). A tokenizer without a
    Rust backend, or whose decode adds a clean-up pass (clean_up_tokenization_spaces), which the stream does not
    apply, decodes the prefix."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.sent = tokenizer, [], ""
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        streams = self.backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self.stream = DecodeStream(skip_special_tokens=True) if streams else None

    def add(self, ids: list[int], final: bool = False) -> str:
        self.ids += ids
        if self.stream is not None:
            new = "".join(piece for piece in map(functools.partial(self.stream.step, self.backend), ids) if piece)
            if final:  # a character whose bytes never all came, as decode renders it
                text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
                new += text[len(self.sent) + len(new):] if text.startswith(self.sent + new) else ""
            self.sent += new
            return new
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):
            return ""
        new, self.sent = text[len(self.sent):], text
        return new
