"""InfiniBand / RoCE port counters from ``/sys/class/infiniband/<dev>/ports/<n>/``.

``counters/*`` are the IB PMA counters every HCA has; ``hw_counters/*`` are the driver's
extra ones (mlx5: out_of_buffer, rnr_nak_retry_err, ...) where present.  The reader only
gathers the files' text (what a recording keeps); ``parse`` turns it into series.  Units:
``port_xmit_data`` and ``port_rcv_data`` count 4-byte words, so bytes are 4 times them.
"""

from __future__ import annotations

from topoagent.collectors.base import NoData
from topoagent.collectors.counters import COUNTER, Context, CounterSource, Family, Series, Stuck, Threshold, label_is
from topoagent.node.host import Host
from topoagent.vocabulary import FindingKind, MetricsDetail, Severity

IB_CLASS = "/sys/class/infiniband"
_PORT = ("device", "port")
TRANSMITTED_BYTES = Family("infiniband_port_transmitted_bytes_total", "Bytes an InfiniBand/RoCE port sent (sysfs port_xmit_data x 4).",
                           COUNTER, _PORT, "bytes")
RECEIVED_BYTES = Family("infiniband_port_received_bytes_total", "Bytes an InfiniBand/RoCE port received (sysfs port_rcv_data x 4).",
                        COUNTER, _PORT, "bytes")
# Packets: read for the stuck-counter rules (bytes and packets move together), served
# with [metrics] detail "packets" only: bytes say what a port carries (series budget).
TRANSMITTED_PACKETS = Family("infiniband_port_transmitted_packets_total", "Packets an InfiniBand/RoCE port sent.", COUNTER, _PORT,
                             detail=MetricsDetail.PACKETS)
RECEIVED_PACKETS = Family("infiniband_port_received_packets_total", "Packets an InfiniBand/RoCE port received.", COUNTER, _PORT,
                          detail=MetricsDetail.PACKETS)
TRANSMIT_WAIT = Family("infiniband_port_transmit_wait_total",
                       "Ticks a port had data to send but no credits (port_xmit_wait): congestion.", COUNTER, _PORT)
# The error counters the agent judges (THRESHOLDS below; the alert rules read the same):
# served by default, one series each per port; the other dozen with [metrics] detail "errors".
JUDGED = frozenset({"symbol_error", "link_error_recovery", "link_downed", "port_rcv_errors"})
ERRORS = Family("infiniband_port_errors_total",
                "Error counters of an InfiniBand/RoCE port; counter is the sysfs name (counters/ and hw_counters/): "
                "those the agent judges, every one with [metrics] detail \"errors\".",
                COUNTER, (*_PORT, "counter"), detail=MetricsDetail.ERRORS, default=(("counter", JUDGED),))
FAMILIES = (TRANSMITTED_BYTES, RECEIVED_BYTES, TRANSMITTED_PACKETS, RECEIVED_PACKETS, TRANSMIT_WAIT, ERRORS)

# The counters/ files that are traffic, not errors: (their family, multiplier).
TRAFFIC = {
    "port_xmit_data": (TRANSMITTED_BYTES, 4),  # 4-byte words
    "port_rcv_data": (RECEIVED_BYTES, 4),
    "port_xmit_packets": (TRANSMITTED_PACKETS, 1),
    "port_rcv_packets": (RECEIVED_PACKETS, 1),
    "port_xmit_wait": (TRANSMIT_WAIT, 1),
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

THRESHOLDS = (
    Threshold("symbol_error_per_s", ERRORS, label_is("counter", "symbol_error"), 0.01,
              FindingKind.IB_ERRORS_RISING, Severity.WARNING, "symbol errors"),
    Threshold("link_error_recovery_per_s", ERRORS, label_is("counter", "link_error_recovery"), 0.0,
              FindingKind.IB_ERRORS_RISING, Severity.WARNING, "link error recoveries"),
    Threshold("link_downed_per_s", ERRORS, label_is("counter", "link_downed"), 0.0,
              FindingKind.IB_ERRORS_RISING, Severity.CRITICAL, "link downed events (the port flaps)"),
    Threshold("port_rcv_errors_per_s", ERRORS, label_is("counter", "port_rcv_errors"), 0.1,
              FindingKind.IB_ERRORS_RISING, Severity.WARNING, "receive errors"),
)

# Data and packet counters move together: one standing still while the other rises (or
# at its maximum) no longer says what the port carries.
STUCK = (
    Stuck(TRANSMITTED_BYTES, "port_xmit_data", 4, TRANSMITTED_PACKETS),
    Stuck(RECEIVED_BYTES, "port_rcv_data", 4, RECEIVED_PACKETS),
    Stuck(TRANSMITTED_PACKETS, "port_xmit_packets", 1, TRANSMITTED_BYTES),
    Stuck(RECEIVED_PACKETS, "port_rcv_packets", 1, RECEIVED_BYTES),
)


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
            family, factor = TRAFFIC[name]
            series.append((family.name, labels, float(value * factor)))
        elif (folder == "counters" and name not in NOT_ERRORS) or (folder == "hw_counters" and name in HW_ERRORS):
            series.append((ERRORS.name, (*labels, ("counter", name)), float(value)))
    return series


def read(context: Context) -> Raw:
    return read_raw(context.host)


SOURCE = CounterSource("infiniband_counters", read, parse, FAMILIES, THRESHOLDS, STUCK)
