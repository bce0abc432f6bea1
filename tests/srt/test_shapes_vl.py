"""The trained `shapes-vl` demo model as shipped: it loads in Hugging Face transformers (LLaVA
class, PIL image processor), genserve's runtime gives HF's greedy tokens, and it really reads
held-out pictures it never saw (perturbed: other sizes, JPEG, blur, colour jitter)."""

from __future__ import annotations

import pytest

from genserve.demo_models import vl_data, vl_evaluate, world
from genserve.demo_models.vl_model import IMAGE_SIZE, WEIGHTS_PATH
from tests.srt.vlm_models import hf_reference


@pytest.fixture(scope="module")
def engine():
    engine = vl_evaluate.load_engine()
    yield engine
    engine.shutdown()


def test_loads_in_transformers_with_the_pil_image_processor():
    import transformers as tf

    model = tf.LlavaForConditionalGeneration.from_pretrained(WEIGHTS_PATH)
    proc = tf.AutoImageProcessor.from_pretrained(WEIGHTS_PATH)
    tok = tf.AutoTokenizer.from_pretrained(WEIGHTS_PATH)
    assert type(proc).__name__ == "CLIPImageProcessorPil"
    assert model.config.vision_config.image_size == IMAGE_SIZE == 48
    assert (proc.size["height"], proc.size["width"]) == (IMAGE_SIZE, IMAGE_SIZE)
    text = tok.apply_chat_template(
        vl_data.messages("What colour is the shape?"), tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n") and "<image>" in text
    sentence = "a red circle on a white background, top left"
    assert tok.decode(tok.encode(sentence, add_special_tokens=False)) == sentence


def test_runtime_tokens_equal_hf(engine):
    scenes, images = vl_evaluate.held_out_pictures(2, seed=5)
    for question, image in zip(["Describe the image.", "Where is the shape?"], images):
        text = engine.tokenizer.apply_chat_template(
            vl_data.messages(question), tokenize=False, add_generation_prompt=True
        )
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        out = engine.generate(
            input_ids=ids,
            image_data=[image],
            sampling_params={"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
        )
        assert out["output_ids"] == hf_reference(WEIGHTS_PATH, ids, [image], 16)
    engine.check_integrity()


def test_describes_and_answers_held_out_pictures(engine):
    # 24 held-out scenes, perturbed; the bounds sit below the evaluated figures
    # (docs/benchmarks.md) so that only a broken model or runtime fails them.
    scenes, images = vl_evaluate.held_out_pictures(24, seed=7)
    report = vl_evaluate.accuracy(engine, scenes, images)
    describe, questions = report["describe"], report["questions"]
    for attr in ("colour", "background", "position"):
        assert describe[attr] >= 0.95 and questions[attr] >= 0.95, (attr, report)
    assert describe["shape"] >= 0.85 and questions["shape"] >= 0.85, report
    assert describe["all"] >= 0.85, report
    # Every description follows the grammar.
    assert not [d for _, d in report["wrong_descriptions"] if world.parse_prompt(d) is None]
    engine.check_integrity()


def test_short_answers_are_single_attributes(engine):
    scene = world.Scene("red", "circle", "white", position="top left")
    image = vl_evaluate.png(world.render_image(scene))
    answers = {
        kind: vl_evaluate.ask(engine, [image], vl_data.QUESTIONS[kind][0])[0]
        for kind in ("describe", "colour", "shape", "position", "background")
    }
    assert answers == {
        "describe": "a red circle on a white background, top left",
        "colour": "red",
        "shape": "circle",
        "position": "top left",
        "background": "white",
    }


def test_served_by_name():
    from genserve.srt.model_loader import resolve_model_folder

    assert resolve_model_folder("shapes-vl") == (WEIGHTS_PATH, "shapes-vl")
