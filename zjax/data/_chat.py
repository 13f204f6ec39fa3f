"""Chat templates: a conversation rendered as the tokenizer's own template renders it, with
the character spans of the assistant's turns (what a completion-only loss trains on).

The template is the ``chat_template`` of the ``tokenizer_config.json`` beside the
``tokenizer.json`` (or a ``chat_template.jinja`` there), rendered with Jinja2 as transformers
renders it: a sandboxed environment with ``trim_blocks`` and ``lstrip_blocks``, loop
controls, transformers' ``tojson``, ``raise_exception`` and ``strftime_now``, and the special
tokens (``bos_token``, ``eos_token``, ...) as variables.

The assistant spans come from the template's ``{% generation %}`` blocks where it has them
(as ``return_assistant_tokens_mask`` reads them); otherwise by prefixes: turn ``i`` is what
rendering ``messages[:i + 1]`` adds to ``messages[:i]`` with its generation prompt, less the
whitespace that ends it (the newline between turns, after the end-of-turn token). A template
for which those are not prefixes of the whole conversation is refused (it needs
``{% generation %}`` blocks).
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from zjax.errors import ConfigError, did_you_mean

__all__ = ["ROLES", "ChatTemplate", "check_messages", "load_chat_template", "span_mask",
           "special_token", "tokenizer_config"]

ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def tokenizer_config(tokenizer_path: str | Path) -> dict:
    """The ``tokenizer_config.json`` beside ``tokenizer_path`` ({} when there is none)."""
    path = Path(tokenizer_path).parent / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a JSON tokenizer config: {e}") from None


def special_token(config: dict, name: str) -> str | None:
    """A special token's text (``eos_token`` etc.; written as a string or ``{content}``)."""
    value = config.get(name)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_text(tokenizer_path: str | Path, config: dict) -> str | None:
    jinja = Path(tokenizer_path).parent / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def load_chat_template(tokenizer_path: str | Path, *, key: str = "data.format") -> ChatTemplate:
    """The chat template shipped beside ``tokenizer_path``.

    Raises:
      ConfigError: naming the files looked in, when none holds a template.
    """
    config = tokenizer_config(tokenizer_path)
    text = _template_text(tokenizer_path, config)
    if text is None:
        where = Path(tokenizer_path).parent
        raise ConfigError(f"{key}: chat needs a chat template, but neither "
                          f"{where / 'tokenizer_config.json'} (chat_template) nor "
                          f"{where / 'chat_template.jinja'} holds one")
    tokens = {k: special_token(config, k) for k in config if k.endswith("_token")}
    return ChatTemplate(text, {k: v for k, v in tokens.items() if v is not None})


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Tracker(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: records where each block starts and
        ends in the output rendered so far."""

        tags = frozenset({"generation"})

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(track_generation=self.track)
            self._blocks: list[str] | None = None
            self._spans: list[tuple[int, int]] = []

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_block"), [], [], body
                                          ).set_lineno(lineno)

        def _block(self, caller):
            out = caller()
            if self._blocks is not None:
                start = sum(map(len, self._blocks))
                self._spans.append((start, start + len(out)))
            return out

        @contextmanager
        def track(self, blocks: list[str], spans: list[tuple[int, int]]):
            self._blocks, self._spans = blocks, spans
            try:
                yield
            finally:
                self._blocks, self._spans = None, []

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Tracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    def __init__(self, text: str, special_tokens: dict[str, str]):
        import jinja2

        self.text, self.special_tokens = text, dict(special_tokens)
        self.tracks = bool(_GENERATION.search(text))
        try:
            self._template = _environment().from_string(text)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"chat template: not a Jinja2 template: {e.message} (line "
                              f"{e.lineno})") from None

    def render(self, messages: Sequence[dict], *, add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages``."""
        return self._render(messages, add_generation_prompt)[0]

    def _render(self, messages, add_generation_prompt: bool) -> tuple[str, list]:
        import jinja2

        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        ctx = dict(self.special_tokens, messages=list(messages),
                   add_generation_prompt=add_generation_prompt)
        try:
            with self._template.environment.track_generation(blocks, spans):
                for block in self._template.generate(**ctx):
                    blocks.append(block)
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template failed: {e}") from None
        return "".join(blocks), list(spans)

    def render_with_spans(self, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
        """``(text, [(start, end), ...])``: the conversation and its assistant turns' spans.

        Raises:
          ValueError: the template failed, or (without ``{% generation %}`` blocks) its
            renderings of the conversation's prefixes are not prefixes of the whole.
        """
        text, spans = self._render(messages, False)
        if self.tracks:
            return text, spans
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = self._render(messages[:i], True)[0]
            upto = self._render(messages[: i + 1], False)[0]
            if not (text.startswith(upto) and upto.startswith(before)):
                raise ValueError(
                    "the chat template's rendering of the turns before an assistant turn is "
                    "not a prefix of the whole conversation, so where the assistant's tokens "
                    "are is unknown; mark them with {% generation %}...{% endgeneration %} in "
                    "the template, or set data.train_on_prompt: true")
            end = len(upto)
            while end > len(before) and upto[end - 1].isspace():  # the newline between turns
                end -= 1
            spans.append((len(before), end))
        return text, spans


def check_messages(value, field: str, where: str) -> list[dict]:
    """``value`` checked as a non-empty list of ``{role, content}`` messages, each role one
    of :data:`ROLES` and each content text (an error names ``where`` and ``field``)."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: field {field!r} must be a non-empty list of "
                          f"{{role, content}} messages, got {type(value).__name__}")
    for i, m in enumerate(value):
        at = f"{where}: field {field!r}, message {i}"
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ConfigError(f"{at}: expected {{role, content}}, got {str(m)[:80]!r}")
        if m["role"] not in ROLES:
            raise ConfigError(f"{at}: unknown role {m['role']!r}"
                              f"{did_you_mean(str(m['role']), ROLES)}; roles: "
                              f"{', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise ConfigError(f"{at}: content holds {type(m['content']).__name__}, expected "
                              "text (a string)")
    return value


def span_mask(encoding, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """1 on the tokens from the one holding each span's first character to the one holding
    its last (``return_assistant_tokens_mask``'s rule), for a tokenizer's ``encoding`` of the
    rendered text and the spans :meth:`ChatTemplate.render_with_spans` gives."""
    mask = np.zeros(len(encoding.ids), np.uint8)
    for start, end in spans:
        if end <= start:
            continue
        first = encoding.char_to_token(start)
        last = encoding.char_to_token(end - 1)
        if first is None:  # past the encoded text
            break
        mask[first:len(mask) if last is None else last + 1] = 1
    return mask
