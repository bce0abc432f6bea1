"""`genserve serve --model-path <tiny GPT-OSS folder in MXFP4>` as a user runs it: the official
openai client gets transformers' greedy answer (its `Mxfp4Config(dequantize=True)` reading of
the same folder), and the server reports the checkpoint's format."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.serve_process import serve_process
from tests.srt.models.test_gpt_oss import gpt_oss_config, write_mxfp4
from tests.srt.vlm_models import VOCAB_SIZE, build_tokenizer

pytestmark = pytest.mark.slow

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    import transformers as tf

    from tests.srt.hf_equality import save_tiny

    plain = tmp_path_factory.mktemp("gpt-oss-plain")
    tok = build_tokenizer(plain)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = gpt_oss_config(vocab_size=VOCAB_SIZE, eos_token_id=eos, bos_token_id=None)
    save_tiny(tf.GptOssForCausalLM, cfg, plain)
    quantized, _ = write_mxfp4(plain, tmp_path_factory.mktemp("gpt-oss-mxfp4"))
    for f in plain.iterdir():  # the tokenizer files
        if f.suffix != ".safetensors" and f.name != "config.json":
            (quantized / f.name).write_bytes(f.read_bytes())
    return quantized


def test_openai_client_gets_the_transformers_answer(folder):
    import openai
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(folder)
    hf = tf.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=tf.Mxfp4Config(dequantize=True)).eval()
    messages = [{"role": "user", "content": "what is a red circle ?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                          do_sample=False, pad_token_id=0)
    new = out[0, len(ids):].tolist()
    assert len(set(new)) >= 3, f"degenerate reference output {new}; reseed the model"
    want = tok.decode(new, skip_special_tokens=True)
    assert want.strip(), new
    with serve_process("--model-path", str(folder), "--max-total-tokens", "2048") as url:
        info = httpx.get(url + "/get_model_info").json()
        assert info["architecture"] == "GptOssForCausalLM"
        assert info["checkpoint_quantization"].startswith("mxfp4"), info
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                           temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == MAX_TOKENS
        assert r.choices[0].message.content == want
