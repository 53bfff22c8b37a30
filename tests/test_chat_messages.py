"""Chat messages: one rule (``checks.chat_messages``) for the runner's rows and the engine's
prompts, so a message one accepts the other does not refuse."""

from __future__ import annotations

import pytest

from dflash_batch import checks
from dflash_batch.completion import GenerationError
from dflash_batch.runner.items import read_items
from tests.runner_fixtures import real_engine, tiny_models, write_jsonl  # noqa: F401


def user(content):
    return [{"role": "user", "content": content}]


BAD = [
    ([{"role": "bogus", "content": "Hi"}], "messages[0].role must be one of"),
    (user(5), "messages[0].content must be a string"),
    (user([{"type": "text", "text": 5}]), "messages[0].content[0].text must be a string, got int"),
    (user([{"type": "image_url", "image_url": {}}]), "messages[0].content[0].type must be 'text'"),
    ([{"role": "system", "content": "S"}] + user(" "), "no non-empty user or assistant content"),
]


def read_one(tmp_path, messages):
    [item] = read_items(write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "messages": messages}]))
    return item


@pytest.mark.parametrize("messages, says", BAD)
def test_engine_and_runner_refuse_the_same_messages_alike(tmp_path, real_engine, messages, says):
    item = read_one(tmp_path, messages)
    with pytest.raises(GenerationError) as refused:
        real_engine.request(messages)
    assert says in item.error and says in str(refused.value)
    assert item.error == f"line 1: {refused.value}"  # one rule, one message


def test_engine_takes_what_the_runner_takes(tmp_path, real_engine):
    parts = [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi."}]
    messages = [{"role": "developer", "content": "Be brief."}] + user(parts)
    item = read_one(tmp_path, messages)
    both = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
    assert item.prompt == checks.chat_messages(messages) == both
    assert real_engine.encode(messages) == real_engine.encode(item.prompt)
