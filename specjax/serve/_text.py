"""Text in and out: the plain chat template, and detokenizing a stream of ids."""

from __future__ import annotations

# The chat template of models whose tokenizer has none (the bundled code models): a line per message,
# "role: content", then "assistant:" for the reply.
PLAIN_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                       "{% if add_generation_prompt %}assistant:{% endif %}")


class Detokenizer:
    """Text of a growing list of ids, emitted as it becomes final: the whole prefix is decoded again and the
    new suffix sent, held back while it ends inside a character whose bytes have not all come."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.sent = tokenizer, [], ""

    def add(self, ids: list[int], final: bool = False) -> str:
        self.ids += ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):
            return ""
        new, self.sent = text[len(self.sent):], text
        return new
