"""Per-request errors never crash the engine; the public API (generate, stream, n, stop, config)."""
from __future__ import annotations

import json

import pytest
from core_helpers import bits, make_llm, workload
from pydantic import ValidationError

from shuili import LLM, RequestOutput, SamplingParams
from shuili.core.config import EngineConfig
from shuili.core.errors import FieldErrors, describe

PROMPTS, PARAMS = workload(6, seed=3)


@pytest.fixture(scope="module")
def llm():
    return make_llm(max_model_len=64)


def test_invalid_sampling_params_name_the_field():
    with pytest.raises(ValueError, match="^top_p: "):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="^temperature: "):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match="^temprature: unknown field"):
        SamplingParams(temprature=1.0)
    with pytest.raises(ValueError, match="^seed: "):
        SamplingParams(seed=-1)


def test_bad_requests_get_errors_and_others_run(llm, solo_results):
    ref = solo_results(PROMPTS[:2], PARAMS[:2])
    prompts = [PROMPTS[0], "", "x" * 80, [999999], PROMPTS[1]]
    params = [PARAMS[0], PARAMS[0], PARAMS[0], PARAMS[0], PARAMS[1]]
    outs = llm.generate(prompts, params)
    assert [o.finish_reason for o in outs] == [PARAMS[0].max_tokens and "length", "error", "error", "error", "length"]
    assert "empty prompt" in outs[1].error
    assert "max_model_len" in outs[2].error and "shorten" in outs[2].error
    assert "[0, 260)" in outs[3].error
    assert bits(outs[0]) == ref[0] and bits(outs[4]) == ref[1]
    llm.engine.scheduler.check()


def test_nan_logits_finish_only_that_request(solo_results):
    ref = solo_results(PROMPTS[:3], PARAMS[:3])
    used = {t for r in ref for t in r[0]}
    poison = next(t for t in (259, 258, 257, 255, 254) if t not in used)  # only the bad prompt has it
    llm = make_llm({"nan_token": poison})
    outs = llm.generate([PROMPTS[0], [111, 107, poison, 63], PROMPTS[1], PROMPTS[2]],
                        [PARAMS[0], PARAMS[0], PARAMS[1], PARAMS[2]])
    assert outs[1].finish_reason == "error" and "NaN" in outs[1].error
    assert [bits(outs[i]) for i in (0, 2, 3)] == ref
    llm.engine.scheduler.check()
    assert all(u["used"] == 0 for u in llm.engine.kv.usage().values())


def test_request_too_big_for_the_cache():
    llm = make_llm(num_blocks=3)
    (out,) = llm.generate(["abc"], SamplingParams(max_tokens=50))
    assert out.finish_reason == "error" and "num_blocks" in out.error


def test_outputs_in_input_order_with_n_and_seeds(llm):
    p = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    outs = llm.generate(["one", "two"], p)
    assert len(outs) == 2 and [o.prompt for o in outs] == ["one", "two"]
    first = outs[0].outputs
    assert [c.index for c in first] == [0, 1, 2] and [c.seed for c in first] == [11, 12, 13]
    assert all(len(c.token_ids) == 6 == len(c.logprobs) and c.finish_reason == "length" for c in first)
    assert len({tuple(c.token_ids) for c in first}) > 1
    with pytest.raises(ValueError, match="read .outputs"):
        outs[0].text  # noqa: B018 - ambiguous with n=3
    # any answer replays alone from its recorded seed
    replay = llm.generate(["one"], p.model_copy(update={"n": 1, "seed": first[1].seed}))[0]
    assert bits(replay) == bits(first[1])


@pytest.mark.parametrize("prompts, expect", [
    ([["a", "b"]], "prompts[0] is a list containing str 'a'"),
    (["ok", None], "prompts[1] is NoneType"),
    ([3.5], "prompts[0] is float"),
    (7, "prompts is a int"),
])
def test_bad_prompt_types_name_the_index(llm, prompts, expect):
    with pytest.raises(TypeError) as info:
        llm.generate(prompts, SamplingParams(max_tokens=1))
    assert str(info.value).startswith(expect)


def test_prompt_forms_match_vllm(llm):
    p = SamplingParams(temperature=0.0, max_tokens=2)
    ids = [104, 105]
    forms = [llm.generate(x, p) for x in ("hi", ids, [ids], {"prompt": "hi"}, [{"prompt_token_ids": ids}])]
    assert all(len(outs) == 1 for outs in forms)
    assert len({bits(outs[0]) for outs in forms}) == 1


def test_chat_renders_the_template(llm):
    p = SamplingParams(temperature=0.0, max_tokens=1)
    (chat,) = llm.chat([{"role": "user", "content": "hi"}], p)
    assert chat.prompt_token_ids == list(b"<user>hi<bot>")
    assert len(llm.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]], p)) == 2
    with pytest.raises(TypeError, match="conversation 0"):
        llm.chat([["hi"]], p)


def test_unseeded_request_records_a_replayable_seed(llm):
    p = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    first = llm.generate(["hello"], p)[0]
    assert first.seed is not None
    again = llm.generate(["hello"], p.model_copy(update={"seed": first.seed}))[0]
    assert bits(again) == bits(first)


def test_stream_yields_incremental_outputs(llm):
    p = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    seen = list(llm.stream(["ab", "cd"], p))
    final = {o.request_id: o for o in seen if o.finished}
    assert len(final) == 2
    lengths = [len(o.token_ids) for o in seen if o.request_id == next(iter(final))]
    assert lengths == sorted(lengths) and lengths[-1] == 5
    assert isinstance(seen[0], RequestOutput)


def test_stream_groups_the_n_samples_of_a_prompt_like_generate(llm):
    p = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, n=2, seed=9)
    seen = list(llm.stream(["ab"], p))
    assert all(len(o.outputs) == 2 for o in seen) and [o.finished for o in seen].count(True) == 1
    (want,) = llm.generate(["ab"], p)
    assert seen[-1].finished and len(want.outputs) == 2
    assert [(c.token_ids, c.logprobs) for c in seen[-1].outputs] == [(c.token_ids, c.logprobs) for c in want.outputs]


def test_stop_strings_and_token_ids(llm):
    base = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (free,) = llm.generate(["stop test"], base)
    assert len(free.token_ids) == 12
    tok = free.token_ids[4]
    (by_id,) = llm.generate(["stop test"], base.model_copy(update={"stop_token_ids": [tok]}))
    assert by_id.finish_reason == "stop" and by_id.token_ids[-1] == tok
    assert len(by_id.token_ids) == free.token_ids.index(tok) + 1
    k = next(i for i, t in enumerate(free.token_ids) if i > 0 and 32 < t < 127)
    stop = chr(free.token_ids[k])
    (by_str,) = llm.generate(["stop test"], base.model_copy(update={"stop": [stop]}))
    assert by_str.finish_reason == "stop" and stop not in by_str.text
    assert by_str.text == free.text[: free.text.index(stop)]
    assert by_str.token_ids == free.token_ids[: free.token_ids.index(free.token_ids[k]) + 1]


def test_max_model_len_and_min_tokens(llm):
    (o,) = llm.generate(["x" * 60], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    assert len(o.token_ids) == 4 and o.finish_reason == "length"  # 60 + 4 = max_model_len 64
    stops = list(range(256))  # every byte stops, but not before min_tokens
    (m,) = llm.generate(["hi"], SamplingParams(temperature=1.0, seed=0, max_tokens=20, min_tokens=5,
                                               stop_token_ids=stops))
    assert len(m.token_ids) >= 5 and all(t not in stops for t in m.token_ids[:4])


def test_prompt_logprobs_match_decode_logprobs(llm):
    """Decode == prefill: a generated token's logprob equals its prompt logprob on re-feeding."""
    p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (gen,) = llm.generate(["perplexity"], p)
    ids = gen.prompt_token_ids + gen.token_ids
    (pl,) = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=True))
    assert len(pl.prompt_logprobs) == len(ids) - 1
    assert pl.prompt_logprobs[-6:] == gen.logprobs


def test_abort_mid_generation(llm):
    eng = llm.engine
    r = eng.add_request("abort me", SamplingParams(max_tokens=30, ignore_eos=True))
    eng.step()
    out = eng.abort(r.request_id)
    assert out.finish_reason == "abort" and out.finished
    assert not eng.has_unfinished()
    eng.scheduler.check()


def test_chat_template_only_when_asked(llm):
    p = SamplingParams(temperature=0.0, max_tokens=1)
    plain = llm.generate(["hi"], p)[0]
    chat = llm.generate(["hi"], p, apply_chat_template=True)[0]
    assert plain.prompt_token_ids == list(b"hi")
    assert chat.prompt_token_ids == list(b"<user>hi<bot>")


def test_engine_config_from_json_and_toml(tmp_path):
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"model": "tiny-v4", "platform": "reference", "max_num_seqs": 3}))
    t = tmp_path / "c.toml"
    t.write_text('model = "tiny-v4"\nmax_num_batched_tokens = 99\npolicy = "priority"\n'
                 '[platform]\nplatform = "reference"\n')
    a = EngineConfig.from_file(str(j))
    b = EngineConfig.from_file(str(t), max_num_seqs=5)
    assert a.max_num_seqs == 3 and a.platform.platform == "reference"
    assert b.max_num_batched_tokens == 99 and b.policy == "priority" and b.max_num_seqs == 5
    with pytest.raises(ValueError, match="^max_num_seqs: must be >= 1, got 0$"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="^polcy: unknown field"):
        EngineConfig(polcy="fcfs")


def test_max_model_len_above_the_model_is_refused():
    with pytest.raises(ValueError, match="exceeds the model's limit"):
        make_llm(max_model_len=10_000)


def test_lazy_top_level_exports():
    import shuili

    assert shuili.LLM is LLM and shuili.SamplingParams is SamplingParams


def test_validation_errors_read_one_line_per_field():
    """Raised as FieldErrors, a ValueError as vLLM raises, not pydantic's raw text."""
    with pytest.raises(FieldErrors) as info:
        SamplingParams(temperature=-1, top_p=0, temprature=1.0)
    assert str(info.value).splitlines() == info.value.problems == [
        "temperature: must be >= 0 (0 = greedy), got -1",
        "top_p: must be in (0, 1] (1 turns it off), got 0",
        "temprature: unknown field (check its spelling)"]
    with pytest.raises(FieldErrors, match=r"^temperature: input should be a finite number, got nan$"):
        SamplingParams(temperature=float("nan"))
    # the server validates request bodies with model_validate: pydantic's error, formatted the same
    with pytest.raises(ValidationError) as info:
        SamplingParams.model_validate({"min_p": 2})
    assert describe(info.value) == "min_p: must be in [0, 1] (0 turns it off), got 2"


@pytest.mark.parametrize("name, text, expect", [
    ("bad.json", '{"max_num_seqs": 2\n "policy": "fcfs"}', "bad.json:2:2: not valid JSON"),
    ("bad.toml", "max_num_seqs = \n", "bad.toml: not valid TOML"),
    ("list.json", "[1, 2]", "list.json: expected an object of EngineConfig fields, got list"),
    ("range.toml", "max_num_seqs = 0\n", "range.toml: max_num_seqs: must be >= 1, got 0"),
])
def test_config_file_errors_name_the_file(tmp_path, name, text, expect):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        EngineConfig.from_file(str(path))
    assert str(info.value).startswith(str(tmp_path / expect.split(":")[0]) + expect[len(name):])


def test_llm_defaults_to_the_cli_model(monkeypatch):
    from shuili.core import api
    from shuili.core.cli import _config
    from shuili.cli import build_parser

    monkeypatch.setattr(api, "Engine", lambda config, model=None: type("E", (), {"config": config}))
    cli_args = build_parser().parse_args(["generate", "--prompt", "x"])
    assert LLM().engine.config == _config(cli_args)
    assert LLM().engine.config.model == "smollm2-135m"
