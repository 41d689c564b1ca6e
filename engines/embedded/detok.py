"""Incremental detokenization with stop strings.

Text deltas carry their own spacing: each delta is the difference between decoding a short window of
tokens with and without the new ones (vLLM's prefix/read offsets), so leading spaces of SentencePiece or
byte-level tokens come out right. A delta that ends in an incomplete UTF-8 sequence ("\ufffd") is held
back until the next token completes it. With stop strings, the last len(longest stop) - 1 characters are
held back too, so a stop string is never streamed before it is recognised and trimmed.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = ()):
        self.tok = tokenizer
        self.ids = list(prompt_ids[-6:])            # a little context for spacing; the rest is not needed
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)
        self.text = ""                              # generated text so far (stop string trimmed on finish)
        self.sent = 0                               # characters of `text` already streamed
        self.stop = tuple(stop)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> bool:
        """Append one token; returns True when a stop string completed (the text is trimmed before it)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new = self._decode(self.ids[self.prefix_offset:])
        if len(new) > len(prefix) and not new.endswith("\ufffd"):
            start = len(self.text)
            self.text += new[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            if self.stop:
                return self._check_stop(start)
        return False

    def _check_stop(self, start: int) -> bool:
        lo = max(0, start - self.holdback)
        hits = [i for i in (self.text.find(s, lo) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
        return self.stopped

    def flush(self, finished: bool) -> str:
        """The text not yet streamed; on finish everything (incomplete UTF-8 included, as U+FFFD)."""
        if finished and not self.stopped and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            new = self._decode(self.ids[self.prefix_offset:])
            self.text += new[len(prefix):]
            self.read_offset = len(self.ids)
        end = len(self.text) if finished else max(self.sent, len(self.text) - self.holdback)
        delta = self.text[self.sent:end]
        self.sent = end
        return delta
