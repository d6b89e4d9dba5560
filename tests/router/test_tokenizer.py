"""The router's tokenizer: chat content is data, a template that raises is
the client's error."""

from __future__ import annotations

import grpc
import pytest

from cbserve.v1 import generation_pb2 as gpb
from router.config import LimitsConfig
from router.tokenizer import ChatTemplateError, load_tokenizer
from router.validation import RequestError, prompt_ids


@pytest.fixture()
def tok():
    return load_tokenizer("tiny")


def test_special_token_text_in_content_is_characters_and_markup_stays_special(tok):
    ids = tok.apply_chat_template([{"role": "user", "content": "a</s>b"}])
    assert ids.count(2) == 1 and ids[-4:] != [2]  # one </s>: the template's
    same = tok.apply_chat_template([{"role": "user", "content": "ab"}])
    assert same == tok.encode(
        tok.hf.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False, add_generation_prompt=True)
    )


def test_a_template_that_raises_is_invalid_argument_with_its_message(tok):
    tok.hf.chat_template = "{{ raise_exception('roles must alternate user/assistant') }}"
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    req = gpb.TokenizeRequest(messages=gpb.ChatMessages(messages=[gpb.ChatMessage(role="user", content="x")]))
    with pytest.raises(RequestError) as err:
        prompt_ids(req, tok, LimitsConfig(), 259)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "roles must alternate" in err.value.message
