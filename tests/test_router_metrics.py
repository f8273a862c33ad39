"""The router's Prometheus text: counters, labelled gauges and latency histograms."""

from __future__ import annotations

from pdd.router.metrics import Metrics


def test_histograms_are_cumulative_with_sum_and_count() -> None:
    m = Metrics()
    for ttft in (0.03, 0.3, 0.3, 100.0):
        m.observe("ttft_seconds", ttft, path="P->RLD->MD")
    m.observe("ttft_seconds", 1.5, path="P->MD")
    text = m.render({})
    assert "# TYPE pdd_router_ttft_seconds histogram" in text
    series = 'pdd_router_ttft_seconds_bucket{path="P->RLD->MD",le='
    assert f'{series}"0.05"}} 1' in text  # 0.03
    assert f'{series}"0.25"}} 1' in text
    assert f'{series}"0.5"}} 3' in text  # + the two 0.3
    assert f'{series}"64"}} 3' in text
    assert f'{series}"+Inf"}} 4' in text  # 100 s is beyond every bucket
    assert 'pdd_router_ttft_seconds_count{path="P->RLD->MD"} 4' in text
    assert 'pdd_router_ttft_seconds_sum{path="P->RLD->MD"} 100.63' in text
    assert 'pdd_router_ttft_seconds_bucket{path="P->MD",le="1"} 0' in text
    assert 'pdd_router_ttft_seconds_bucket{path="P->MD",le="2"} 1' in text


def test_gauges_come_with_their_labels() -> None:
    m = Metrics(active=3)
    labels = (("tier", "relay"), ("url", "http://rld:30001"))
    text = m.render({"instance_load": [(labels, 7)], "wan_bytes_per_second": []})
    assert 'pdd_router_instance_load{tier="relay",url="http://rld:30001"} 7' in text
    assert "pdd_router_active_requests 3" in text
    assert "# TYPE pdd_router_wan_bytes_per_second gauge" in text
