"""Prompts in, token ids out: the target's chat template where it has one, the raw text otherwise.

A chat model asked a bare question often answers with end-of-sequence at once (SmolLM2 does, at
fp32): it was tuned on templated turns. So a ``--prompt`` goes through the template as one user
message (with ``--system`` before it) and the generation prompt after it; ``--raw`` sends the text
as is. Decoding stops at the template's end-of-turn token as well as at EOS.
"""

from __future__ import annotations

from dataclasses import dataclass
from specblock.errors import SpecBlockError

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}

#: End-of-turn tokens of common chat templates; one counts when the template itself writes it.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>", "<|eot|>")


@dataclass(frozen=True)
class ChatRequest:
    """One request as users write it: a plain prompt or OpenAI-style messages."""

    prompt: str | None = None
    messages: tuple[Message, ...] | None = None
    system: str | None = None
    raw: bool = False

    def to_messages(self) -> list[Message]:
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        return msgs + [{"role": "user", "content": self.prompt or ""}]


def has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode(tokenizer, req: ChatRequest) -> list[int]:
    """Token ids for one request; the same function serves the CLI, the bench and the server."""
    if req.raw or not has_template(tokenizer):
        if req.messages is not None:
            if req.raw:
                raise SpecBlockError("raw text cannot carry chat messages; drop --raw or send a prompt")
            raise SpecBlockError("this model's tokenizer has no chat template; send a plain prompt instead of messages")
        return list(tokenizer(req.prompt or "")["input_ids"])
    try:
        ids = tokenizer.apply_chat_template(req.to_messages(), add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
    except Exception as e:  # jinja errors (e.g. a template that refuses a system turn)
        raise SpecBlockError(f"the chat template refused these messages: {str(e).splitlines()[0]}") from None
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def stop_ids(tokenizer, generation_eos: set[int]) -> frozenset[int]:
    """EOS from the generation config (or the tokenizer) plus the template's end-of-turn token."""
    ids = set(generation_eos) or {tokenizer.eos_token_id}
    template = getattr(tokenizer, "chat_template", None) or ""
    unk = getattr(tokenizer, "unk_token_id", None)
    for tok in END_OF_TURN:
        if tok in template:
            tid = tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid != unk:
                ids.add(tid)
    return frozenset(i for i in ids if i is not None)


def parse_messages(obj, where: str) -> tuple[Message, ...]:
    """Validate OpenAI-format messages from a prompt file line or a request body."""
    if not isinstance(obj, list) or not obj:
        raise SpecBlockError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    out = []
    for m in obj:
        if (not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant")
                or not isinstance(m.get("content"), str)):
            raise SpecBlockError(f"{where}: each message needs a role (system, user, assistant) and string content")
        out.append({"role": m["role"], "content": m["content"]})
    return tuple(out)



def encode_prompt(tokenizer, prompt) -> list[int]:
    """An evaluation prompt (``specblock.prompts.Prompt``): its ``instruction`` as one user turn
    where the tokenizer has a chat template (the model's default system message included), its
    lab-format ``text`` otherwise."""
    if has_template(tokenizer):
        return encode(tokenizer, ChatRequest(prompt=prompt.instruction))
    return encode(tokenizer, ChatRequest(prompt=prompt.text, raw=True))
