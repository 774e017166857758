"""InfiniBand / RoCE port counters from ``/sys/class/infiniband/<dev>/ports/<n>/``.

``counters/*`` are the IB PMA counters every HCA has; ``hw_counters/*`` are the driver's
extra ones (mlx5: out_of_buffer, rnr_nak_retry_err, ...) where present.  The reader only
gathers the files' text (what a recording keeps); ``parse`` turns it into series.  Units:
``port_xmit_data`` and ``port_rcv_data`` count 4-byte words, so bytes are 4 times them.
"""

from __future__ import annotations

from topoagent.collectors.base import NoData
from topoagent.node.host import Host

IB_CLASS = "/sys/class/infiniband"
# The counters/ files that are traffic, not errors: (exported metric, multiplier).
TRAFFIC = {
    "port_xmit_data": ("infiniband_port_transmitted_bytes_total", 4),  # 4-byte words
    "port_rcv_data": ("infiniband_port_received_bytes_total", 4),
    "port_xmit_packets": ("infiniband_port_transmitted_packets_total", 1),
    "port_rcv_packets": ("infiniband_port_received_packets_total", 1),
    "port_xmit_wait": ("infiniband_port_transmit_wait_total", 1),
}
# Counters that count neither traffic nor errors (multicast/unicast packet splits).
NOT_ERRORS = frozenset({
    "multicast_rcv_packets", "multicast_xmit_packets", "unicast_rcv_packets", "unicast_xmit_packets",
    "VL15_dropped",  # management packets dropped by design on a busy subnet manager path
})
# hw_counters/ holds request and congestion-notification counts too; these are errors
# (mlx5's documented error and retransmission counters).
HW_ERRORS = frozenset({
    "out_of_buffer", "out_of_sequence", "packet_seq_err", "local_ack_timeout_err", "rnr_nak_retry_err",
    "implied_nak_seq_err", "duplicate_request", "req_cqe_error", "resp_cqe_error", "req_remote_access_errors",
    "req_remote_invalid_request", "resp_local_length_error", "resp_remote_access_errors", "rx_icrc_encapsulated",
})

Raw = dict[str, str]  # "mlx5_0/1/counters/symbol_error" -> the file's text
Series = tuple[str, tuple[tuple[str, str], ...], float]  # (metric, labels, value)


def read_raw(host: Host) -> Raw:
    """Every port counter file's text, keyed ``device/port/dir/name``."""
    devices = host.listdir(IB_CLASS)
    if not devices:
        raise NoData(f"{IB_CLASS}: no RDMA devices")
    raw: Raw = {}
    for device in sorted(devices):
        for port in sorted(host.listdir(f"{IB_CLASS}/{device}/ports")):
            if not port.isdigit():
                continue
            for folder in ("counters", "hw_counters"):
                base = f"{IB_CLASS}/{device}/ports/{port}/{folder}"
                for name in sorted(host.listdir(base)):
                    text = host.read_optional(f"{base}/{name}")
                    if text is not None:
                        raw[f"{device}/{port}/{folder}/{name}"] = text
    return raw


def parse(raw: Raw) -> list[Series]:
    """Files' text -> series; a file that is not one integer (some hw_counters are not
    counters at all, or read as "N/A") is skipped."""
    series: list[Series] = []
    for key, text in sorted(raw.items()):
        try:
            device, port, folder, name = key.split("/")
            value = int(text.strip())
        except ValueError:
            continue
        labels = (("device", device), ("port", port))
        if folder == "counters" and name in TRAFFIC:
            metric, factor = TRAFFIC[name]
            series.append((metric, labels, float(value * factor)))
        elif (folder == "counters" and name not in NOT_ERRORS) or (folder == "hw_counters" and name in HW_ERRORS):
            series.append(("infiniband_port_errors_total", (*labels, ("counter", name)), float(value)))
    return series
