"""kvrt.am_compact_layer_ref (reference queries the caller hands in) and the schedule's query
source: the context's own queries at their positions equal kvrt.am_compact_layer bit for bit,
queries without positions see every key, and a compiled (context) schedule refuses repeat
queries unless overridden."""
import numpy as np
import pytest

import kvrt


def test_layer_ref_equals_layer(acts):
    layer = 15
    q, k, v = acts.qc[layer], acts.kc[layer], acts.vc[layer]
    pos = np.arange(acts.T, dtype=np.int32)
    for sel in ("highest", "omp"):
        a, sa = kvrt.am_compact_layer(q, k, v, ratio=0.2, key_select=sel)
        b, sb = kvrt.am_compact_layer_ref(q, k, v, q_pos=pos, ratio=0.2, key_select=sel)
        for x, y in zip(a.to_numpy(), b.to_numpy()):
            np.testing.assert_array_equal(x, y)
        assert [s["out_relerr"] for s in sa] == [s["out_relerr"] for s in sb]
    # without positions every query sees every key: another compaction, the same budget
    c, _ = kvrt.am_compact_layer_ref(q, k, v, ratio=0.2)
    assert c.counts.tolist() == a.counts.tolist()
    assert kvrt.am_options()["omp_batch"] == 1
    with pytest.raises(kvrt.ArgError, match="omp_batch"):
        kvrt.am_compact_layer_ref(q, k, v, ratio=0.2, omp_batch=0)


def test_schedule_query_source(acts, artifact):
    layer = 0
    q, k, v = acts.qc[layer], acts.kc[layer], acts.vc[layer]
    with kvrt.Policy.open(artifact) as p:
        am = p.am()
        assert am.query_source == "context"
        assert am.self_study_tokens == 0  # only self-study schedules generate
        a, _ = am.compact_scheduled(q, k, v, 0.1, layer)
        b, _ = am.compact_scheduled_ref(q, k, v, 0.1, layer, query_source="context",
                                        q_pos=np.arange(acts.T, dtype=np.int32))
        for x, y in zip(a.to_numpy(), b.to_numpy()):
            np.testing.assert_array_equal(x, y)
        with pytest.raises(kvrt.ArgError, match="calibrated with context"):
            am.compact_scheduled_ref(q, k, v, 0.1, layer, query_source="repeat")
        c, _ = am.compact_scheduled_ref(q, k, v, 0.1, layer, query_source="repeat", override=True)
        assert c.counts.tolist() == a.counts.tolist()


def test_bf16_products(acts):
    """products='bf16' (the logits and P V in bf16, f32 sums) on a real layer: the same budgets,
    the output error on the reference queries within 0.02 of f32's, mostly the same keys; the
    option round-trips through am_options and a bad value is refused naming it."""
    layer = 15
    q, k, v = acts.qc[layer], acts.kc[layer], acts.vc[layer]
    a, sa = kvrt.am_compact_layer(q, k, v, ratio=0.2)
    b, sb = kvrt.am_compact_layer(q, k, v, ratio=0.2, products="bf16")
    assert a.counts.tolist() == b.counts.tolist()
    for x, y in zip(sa, sb):
        assert abs(x["out_relerr"] - y["out_relerr"]) <= 0.02, (x, y)
    def kept(c):
        t = c.to_numpy()
        return {(h, int(p)) for h in range(len(t.offsets) - 1)
                for p in t.positions[t.offsets[h]:t.offsets[h + 1]]}
    ka, kb = kept(a), kept(b)
    assert len(ka & kb) >= 0.8 * len(ka), (len(ka & kb), len(ka))
    assert kvrt.am_options(products="bf16")["products"] == "bf16"
    assert kvrt.am_options()["products"] == "f32"
    with pytest.raises(kvrt.KvrtError, match="products"):
        kvrt.am_options(products="f16")
