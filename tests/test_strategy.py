import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.models import preset
from tessera.strategy import NotAvailableError, Strategy, StrategyError


def test_text_form_round_trips_exactly():
    text = "dp=2,tp=1,pp=1,mbs=2,gbs=16"
    assert Strategy.parse(text).to_text() == text
    full = "dp=2,tp=4,pp=2,sp=2,mbs=1,gbs=64,tp_mode=2d,sp_mode=ulysses,schedule=scp," \
           "recompute=1/0.5,memory=zero1,precision=bf16"
    parsed = Strategy.parse(full)
    assert parsed.to_text() == full
    assert Strategy.parse(parsed.to_text()) == parsed
    megatron = "dp=2,tp=4,pp=1,mbs=2,gbs=16,tp_seq=on"
    assert Strategy.parse(megatron).to_text() == megatron
    assert Strategy.parse(megatron).tp_seq == "on" and Strategy().tp_seq == "off"


def test_every_field_is_parsed():
    s = Strategy.parse("dp=4,tp=1,pp=2,mbs=1,gbs=8,memory=zero3,offload=cpu+disk,"
                       "precision=fp16,recompute=full,schedule=gpipe")
    assert s.offload == ("cpu", "disk") and s.recompute == (1.0,)
    assert s.precision == "fp16" and s.memory == "zero3" and s.schedule == "gpipe"
    assert s.grad_accum_steps == 2 and s.world_size == 8


def test_derived_values():
    s = Strategy.parse("dp=2,tp=4,tp_mode=2d,pp=2,mbs=2,gbs=32,recompute=1/0.25")
    assert s.world_size == 16
    assert s.tp_grid == (2, 2)
    assert s.grad_accum_steps == 8
    assert s.stage_recompute(0) == 1.0 and s.stage_recompute(1) == 0.25


@pytest.mark.parametrize("text, fragment", [
    ("dp=0,mbs=1,gbs=1", "dp must be >= 1"),
    ("dp=two", "dp must be an integer"),
    ("dp=2,mbs=3,gbs=16", "gbs=16 must be a multiple of mbs*dp"),
    ("tp=3,tp_mode=2d", "tp must be a square"),
    ("sp_mode=spiral", "sp_mode must be one of"),
    ("schedule=zigzag", "schedule must be one of"),
    ("memory=zero4", "memory must be one of"),
    ("precision=fp8", "precision must be one of"),
    ("recompute=1.5", "recompute ratios must each lie in [0, 1]"),
    ("pp=2,recompute=1/0.5/0", "recompute has 3 ratios"),
    ("offload=cpu", "offload=cpu needs memory=zero3 or memory=chunk"),
    ("offload=gpu,memory=chunk", "offload must be one of"),
    ("memory=zero1", "needs dp > 1"),
    ("schedule=interleaved", "needs pp >= 2"),
    # A mode whose degree is 1 would act on nothing: refused, not ignored.
    ("schedule=gpipe", "schedule=gpipe orders pipeline stages and needs pp >= 2"),
    ("sp_mode=ulysses", "sp_mode=ulysses lays out sequence parallelism and needs sp > 1"),
    ("tp_mode=2d", "tp=1 with tp_mode=2d: tp must be a square (q*q grid) above 1"),
    ("tp_seq=on", "tp_seq=on splits the sequence over a 1d tensor-parallel group: needs tp > 1"),
    ("tp=4,tp_mode=2d,tp_seq=on", "needs tp > 1 and tp_mode=1d (2d already splits every"),
    ("tp=2,tp_seq=true", "tp_seq must be one of off, on; got 'true'"),
    ("dp=2,dp=2", "given twice"),
    ("dq=2", "unknown strategy field 'dq'"),
    ("dp", "not key=value"),
    ("", "strategy text is empty"),
])
def test_bad_values_name_field_and_rule(text, fragment):
    with pytest.raises(StrategyError) as err:
        Strategy.parse(text)
    assert fragment in str(err.value)


def test_validate_for_world_and_model():
    s = Strategy.parse("dp=2,tp=2,pp=1,mbs=1,gbs=2")
    s.validate_for(world_size=4, model=preset("tiny"))
    with pytest.raises(StrategyError, match="must equal the world size 8"):
        s.validate_for(world_size=8)
    with pytest.raises(StrategyError, match="n_heads=4 is not divisible by 8"):
        Strategy(tp=8).validate_for(model=preset("tiny"))
    with pytest.raises(StrategyError, match="n_layers >= pp"):
        Strategy(pp=3, global_batch_size=3).validate_for(model=preset("tiny"))
    # Schedules' micro-batch rules are checked here too, before any worker starts.
    with pytest.raises(StrategyError, match="schedule=1f1b with pp=2 needs at least 2 micro"):
        Strategy(pp=2, global_batch_size=1).validate_for()
    with pytest.raises(StrategyError, match="interleaved needs the micro-batches per step .3."):
        Strategy(pp=2, global_batch_size=3, schedule="interleaved").validate_for()
    with pytest.raises(StrategyError, match="not divisible by sp"):
        Strategy(sp=3).validate_for(model=preset("tiny"), seq_len=32)
    odd_gqa = preset("tiny", d_model=96, n_heads=12, n_kv_heads=6)
    with pytest.raises(StrategyError, match="n_kv_heads=6 must divide or be divisible by tp"):
        Strategy(tp=4).validate_for(model=odd_gqa)
    Strategy(tp=16).validate_for(model=preset("llama-70b"))  # 8 kv heads repeat over 16
    # Megatron sequence parallelism gives each tp rank 1/tp of the tokens.
    Strategy(tp=2, tp_seq="on").validate_for(model=preset("tiny"), seq_len=32)
    with pytest.raises(StrategyError, match="tp_seq=on splits the sequence over tp=4: sequence "
                                            "length 30 is not divisible by tp"):
        Strategy(tp=4, tp_seq="on").validate_for(model=preset("tiny"), seq_len=30)
    # With sp, each sp rank's tokens are split over tp again (since 2026-11-29).
    Strategy(tp=2, sp=2, tp_seq="on").validate_for(model=preset("tiny"), seq_len=32)
    Strategy.parse("tp=2,sp=2,tp_seq=on").require_available()
    Strategy.parse("tp=2,pp=2,mbs=2,gbs=4,tp_seq=on,tp_overlap=subpipe").require_available()
    with pytest.raises(StrategyError, match="tp_seq=on splits the sequence over tp=4 within "
                                            "sp=2: sequence length 36 is not divisible by tp.sp"):
        Strategy(tp=4, sp=2, tp_seq="on").validate_for(model=preset("tiny"), seq_len=36)


def test_unbuilt_features_are_refused_not_ignored():
    Strategy.parse("dp=4,mbs=1,gbs=4").require_available()
    Strategy.parse("sp=2").require_available()  # sequence parallelism landed (issue 5)
    Strategy.parse("tp=2").require_available()  # tensor parallelism landed (issue 4)
    Strategy.parse("pp=2").require_available()  # pipeline parallelism landed (issue 6)
    Strategy.parse("dp=2,mbs=1,gbs=2,memory=chunk").require_available()  # issue 3
    Strategy.parse("dp=2,pp=2,mbs=1,gbs=4,memory=chunk").require_available()  # dp x pp x chunk
    Strategy.parse("pp=2,mbs=1,gbs=4,memory=chunk,precision=bf16").require_available()
    # chunks in tensor- or sequence-parallel pipeline stages (memory/stages.py)
    Strategy.parse("tp=2,pp=2,mbs=2,gbs=4,memory=chunk").require_available()
    Strategy.parse("sp=2,pp=2,mbs=2,gbs=4,memory=chunk").require_available()
    # tp with bf16/fp16 chunks, and tp x sp with chunks (tests/memory/test_chunk_tp_precision.py)
    Strategy.parse("dp=2,tp=2,mbs=1,gbs=2,memory=chunk,precision=fp16").require_available()
    Strategy.parse("tp=2,sp=2,pp=2,mbs=2,gbs=4,memory=chunk").require_available()
    with pytest.raises(NotAvailableError, match=r"ZeRO memory \(memory=zero2\) is not "
                                                r"available yet.*use memory=ddp, or memory=chunk"):
        Strategy.parse("dp=2,mbs=1,gbs=2,memory=zero2").require_available()
    # Once a runtime lands, its gate opens.
    Strategy(dp=2, global_batch_size=2, memory="zero2").require_available({"ZeRO memory": True})


@pytest.mark.parametrize("text, fragment", [
    ("tp=4,sp=2,tp_mode=2d", "2d tensor (tp_mode=2d) and sequence (sp>1) parallelism together"),
    ("tp=4,tp_mode=2d,pp=2,mbs=2,gbs=4,tp_overlap=subpipe",
     "2d tensor parallelism (tp_mode=2d) and tp_overlap=subpipe together"),
])
def test_compositions_not_built_are_refused_by_name(text, fragment):
    strategy = Strategy.parse(text)
    assert not strategy.is_runnable()
    with pytest.raises(NotAvailableError, match=f"{re.escape(fragment)}.*not available yet"):
        strategy.require_available()


@settings(max_examples=200, deadline=None)
@given(dp=st.integers(1, 64), tp=st.sampled_from([1, 2, 4, 9, 16]), pp=st.integers(1, 8),
       sp=st.integers(1, 8), mbs=st.integers(1, 8), accum=st.integers(1, 8),
       tp_mode=st.sampled_from(["1d", "2d"]), precision=st.sampled_from(["fp32", "bf16"]),
       tp_seq=st.sampled_from(["off", "on"]))
def test_valid_strategies_round_trip(dp, tp, pp, sp, mbs, accum, tp_mode, precision, tp_seq):
    if tp_mode == "2d" and tp not in (4, 9, 16):
        return
    tp_seq = tp_seq if tp > 1 and tp_mode == "1d" else "off"
    s = Strategy(dp=dp, tp=tp, pp=pp, sp=sp, micro_batch_size=mbs,
                 global_batch_size=mbs * dp * accum, tp_mode=tp_mode, precision=precision,
                 tp_seq=tp_seq)
    assert Strategy.parse(s.to_text()) == s
    assert Strategy.from_mapping(s.to_dict()) == s


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_any_text_is_parsed_or_refused_clearly(text):
    try:
        Strategy.parse(text)
    except StrategyError as err:
        assert str(err)
