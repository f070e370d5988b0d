"""Operations: training alerts (NaN, spikes, collapse, flat reward, throughput) and the Prometheus endpoint."""
