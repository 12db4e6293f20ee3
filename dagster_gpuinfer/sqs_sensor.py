"""`sqs_arrival_sensor`: S3 event notifications on an SQS queue become dynamic partitions.

The bucket notifies a queue (`ObjectCreated:*`, filtered to the input prefix and suffix);
each tick receives up to `max_messages_per_tick` messages from it, 10 per long-polled
receive, and registers every new input object as a partition of the pipeline's
`DynamicPartitionsDefinition` (one per file, or one per row or byte range with `split`),
then requests their processing exactly as `arrival_sensor` does (one backfill per tick, or
one run per partition with a run key). It never lists the bucket: the event carries the key
and the size; only a Parquet file being split has its footer read.

When a message is deleted (the queue, not the cursor, says what is left to do):

- Its objects are all registered partitions already (a duplicate, a redelivery, or the
  message of an object registered by an earlier tick): deleted by this tick.
- It announces a new object: this tick returns the partition request and leaves the message
  in flight. Dagster's sensor daemon registers the partition after the evaluation. The next
  tick, if it runs in the same code server process within the visibility timeout, finds the
  partition registered and deletes the message by the receipt it kept; otherwise the
  message becomes visible again `visibility_timeout_seconds` after it was received, a later
  tick receives it, finds the partition registered and deletes it then. A tick that dies
  anywhere between the receive and the registration (the evaluation raised or timed out,
  the daemon stopped) has deleted nothing of it: the message comes back and registers the
  object then. The sensor itself never writes to the instance.
- Poison (not JSON, not an S3 event, an object outside the pipeline's input prefix, suffix
  or glob, or a name Dagster cannot key): logged with its message id and why, then deleted.
  Retrying cannot make it an input, so leaving it to a redrive policy would only receive it
  again, tick after tick, until the policy's maxReceiveCount; the tick log keeps the message
  id and the start of the body. The `s3:TestEvent` message S3 sends when a notification is
  set up, and events other than `ObjectCreated:*` (removals, restores) are deleted too.

Each object is registered once: an object whose key is registered (as a whole or in
ranges) is never requested again, whatever the order or the number of its deliveries; an
object rewritten under the same key is not registered again (as with `arrival_sensor`).
One queue feeds one sensor: a second consumer would receive, and as poison delete, messages
meant for the other pipeline; route prefixes to queues with the notification's filter.

The cursor holds running counts only (messages received, partitions registered, messages
deleted, poison), shown in the UI; SQS keeps the position, so a lost or reset cursor loses
nothing. A new object's message stays in flight for a tick interval, or up to
`visibility_timeout_seconds` when it has to come back: an SQS standard queue allows about
120,000 messages in flight, so a visibility timeout of 60 s carries at least about 2,000
arrivals a second. Receiving stops at half the visibility timeout, so no message comes
back within the tick that received it. AWS credentials come from the standard chain, as
for `s3://` inputs.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlparse

import dagster as dg

from dagster_gpuinfer.arrivals import (
    SplitLargeFiles,
    WatchedFiles,
    plan_partition_keys,
    refused_key_reason,
    registered_file_keys,
)
from dagster_gpuinfer.asset_factory import InferencePipeline
from dagster_gpuinfer.listing import ListedFile
from dagster_gpuinfer.s3_events import PoisonMessage, read_s3_event
from dagster_gpuinfer.sensors import (
    ARRIVAL_SENSOR_TAG,
    arrival_requests,
    dynamic_partitions_of,
    prefix_lister,
)
from dagster_gpuinfer.spec import InputSpec, StorageOptions

QUEUE_CURSOR_VERSION = 1
RECEIVE_BATCH = 10  # SQS's most messages per ReceiveMessage and per DeleteMessageBatch
_COUNTS = ("received", "registered", "deleted", "poison")


def parse_queue_cursor(raw: str | None) -> dict[str, int]:
    """The running counts in the cursor; an empty or unreadable one starts them at zero."""
    counts = dict.fromkeys(_COUNTS, 0)
    try:
        cursor = json.loads(raw) if raw else {}
    except ValueError:
        return counts
    if not isinstance(cursor, dict) or cursor.get("v") != QUEUE_CURSOR_VERSION:
        return counts
    return {name: int(cursor.get(name, 0)) for name in _COUNTS}


def region_of_queue_url(queue_url: str) -> str | None:
    """The AWS region in a queue URL (`https://sqs.eu-west-1.amazonaws.com/123/q`), if any."""
    host = urlparse(queue_url).hostname or ""
    parts = host.split(".")
    if host.endswith(".amazonaws.com") and len(parts) >= 4:
        return parts[1] if parts[0] == "sqs" else parts[0]
    return None


@functools.cache
def sqs_client(queue_url: str, *, region: str | None, endpoint_url: str | None) -> Any:
    """A boto3 SQS client for `queue_url`, one per process (boto3 clients are thread-safe
    and refresh expiring credentials); credentials from the standard AWS chain."""
    try:
        import boto3
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise ImportError("sqs_arrival_sensor needs boto3: install dagster-gpuinfer[aws]") from exc
    return boto3.client(
        "sqs", region_name=region or region_of_queue_url(queue_url), endpoint_url=endpoint_url
    )


# --------------------------------------------------------------------------- one tick, pure


@dataclass
class QueueTick:
    """What the messages of one tick hold, and which of them to delete now.

    Attributes:
        new_files: Input files no partition holds yet, each once, in order of arrival.
        delete: Receipt handles of the messages done with.
        poison: `(message id, why, start of the body)` of messages that no retry makes
            an input of this pipeline.
        in_flight: Messages kept until their new partitions are registered: message id ->
            (receipt handle, the keys it waits for).
    """

    new_files: list[ListedFile] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    poison: list[tuple[str, str, str]] = field(default_factory=list)
    in_flight: dict[str, tuple[str, tuple[str, ...]]] = field(default_factory=dict)
    settled: int = 0
    duplicates: int = 0
    not_arrivals: int = 0
    received: int = 0
    receive_calls: int = 0
    deleted: int = 0


def sort_messages(
    messages: Sequence[Mapping[str, Any]], watched: WatchedFiles, is_known: Callable[[str], bool]
) -> QueueTick:
    """Sort received SQS messages into new files, messages to delete now, and poison."""
    tick = QueueTick()
    new_keys: set[str] = set()
    bucket, _, key_prefix = watched.prefix.removeprefix("s3://").partition("/")
    for message in messages:
        body = message.get("Body", "")
        try:
            files = _input_files(body, watched, bucket, key_prefix)
        except PoisonMessage as exc:
            tick.poison.append((message["MessageId"], str(exc), body[:200]))
            tick.delete.append(message["ReceiptHandle"])
            continue
        if files is None:  # the test event, or only removals and other events
            tick.not_arrivals += 1
            tick.delete.append(message["ReceiptHandle"])
            continue
        unknown = [(key, f) for key, f in files if not is_known(key)]
        if not unknown:
            tick.duplicates += 1
            tick.delete.append(message["ReceiptHandle"])
            continue
        tick.in_flight[message["MessageId"]] = (
            message["ReceiptHandle"],
            tuple(key for key, _ in unknown),
        )
        for key, listed in unknown:
            if key not in new_keys:
                new_keys.add(key)
                tick.new_files.append(listed)
    return tick


def _input_files(
    body: str, watched: WatchedFiles, bucket: str, key_prefix: str
) -> list[tuple[str, ListedFile]] | None:
    """`(file key, file)` of each object the message announces; None when it announces no
    created object at all.

    Raises:
        PoisonMessage: not an S3 event, or an object that is no input of the pipeline.
    """
    event = read_s3_event(body)
    if not event.created:
        return None
    files = []
    for created in event.created:
        where = f"s3://{created.bucket}/{created.key}"
        name = created.key[len(key_prefix) :]
        if created.bucket != bucket or not created.key.startswith(key_prefix):
            raise PoisonMessage(f"{where} is outside the pipeline's input prefix {watched.prefix}")
        key = watched.file_key(name)
        if key is None:
            raise PoisonMessage(
                f"{where} is no input of the pipeline: the name after {watched.prefix} must end "
                f"in {watched.suffix!r}, match {watched.glob!r} and not start with '.' or '_'"
            )
        refused = refused_key_reason(key)
        if refused is not None:
            raise PoisonMessage(f"{where} cannot be a partition: {refused}")
        files.append((key, ListedFile(name, created.size)))
    return files


# --------------------------------------------------------------------------- queue calls


@dataclass(frozen=True)
class QueueReads:
    """How a tick reads the queue (`sqs_arrival_sensor`'s arguments of the same names)."""

    queue_url: str
    max_messages: int
    wait_time_seconds: int
    visibility_timeout_seconds: int
    max_receive_seconds: float

    def __post_init__(self) -> None:
        _check_reads(self)


def receive_messages(client: Any, reads: QueueReads) -> tuple[list[dict[str, Any]], int]:
    """Receive up to `reads.max_messages` messages, 10 a call, until a long poll comes back
    empty or with messages this tick has already received (their visibility timeout ran out
    during the tick), or `max_receive_seconds` have passed.

    Returns:
        The messages, each once with its latest receipt handle (the one SQS deletes by), in
        order of first receipt; and the number of receive calls.
    """
    # Stop at half the visibility timeout at the latest: a message received at the start is
    # then still hidden when the tick deletes it, and never comes back within the tick.
    deadline = time.monotonic() + min(
        reads.max_receive_seconds, reads.visibility_timeout_seconds / 2
    )
    by_id: dict[str, dict[str, Any]] = {}
    calls = 0
    while len(by_id) < reads.max_messages and time.monotonic() < deadline:
        calls += 1
        response = client.receive_message(
            QueueUrl=reads.queue_url,
            MaxNumberOfMessages=min(RECEIVE_BATCH, reads.max_messages - len(by_id)),
            WaitTimeSeconds=reads.wait_time_seconds,
            VisibilityTimeout=reads.visibility_timeout_seconds,
        )
        batch = response.get("Messages", [])
        seen = len(by_id)
        by_id.update((message["MessageId"], message) for message in batch)
        if len(by_id) == seen:
            break
    return list(by_id.values()), calls


def delete_messages(client: Any, queue_url: str, receipt_handles: list[str]) -> list[str]:
    """Delete messages, 10 a call. Returns why each one that SQS refused was refused (an
    expired receipt handle: the message comes back and is deleted by a later tick)."""
    failures: list[str] = []
    for start in range(0, len(receipt_handles), RECEIVE_BATCH):
        batch = [
            {"Id": str(i), "ReceiptHandle": handle}
            for i, handle in enumerate(receipt_handles[start : start + RECEIVE_BATCH])
        ]
        response = client.delete_message_batch(QueueUrl=queue_url, Entries=batch)
        failures.extend(
            f"{failed.get('Code')}: {failed.get('Message')}"
            for failed in response.get("Failed", [])
        )
    return failures


# --------------------------------------------------------------------------- the sensor


def sqs_arrival_sensor(
    pipeline: InferencePipeline,
    *,
    queue_url: str,
    region: str | None = None,
    endpoint_url: str | None = None,
    name: str | None = None,
    glob: str = "*",
    split: SplitLargeFiles | None = None,
    launch: Literal["backfill", "runs"] = "backfill",
    max_messages_per_tick: int = 2_000,
    wait_time_seconds: int = 1,
    visibility_timeout_seconds: int = 60,
    max_receive_seconds: float = 20.0,
    storage: StorageOptions | None = None,
    resource_key: str = "gpu",
    s3_resource_key: str | None = None,
    minimum_interval_seconds: int = 30,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.STOPPED,
    run_tags: Mapping[str, str] | None = None,
    description: str | None = None,
) -> dg.SensorDefinition:
    """A sensor that registers the objects S3 announces on an SQS queue as partitions of
    `pipeline` and processes them; it never lists the bucket (module docstring: when each
    message is deleted).

    Args:
        pipeline: From `inference_assets(...)` with a named `DynamicPartitionsDefinition` and
            an `s3://bucket/prefix/{partition_key}.suffix` input uri.
        queue_url: The queue the bucket's event notification sends to.
        region: The queue's region; default: the one in the queue URL, else the AWS chain's.
        endpoint_url: An SQS-compatible endpoint (moto, LocalStack); default: AWS.
        name: Sensor name; defaults to `<output asset>_sqs_arrivals`.
        glob, split, launch, storage, resource_key, s3_resource_key, run_tags: as for
            `arrival_sensor` (storage and the S3 resource are used to read Parquet footers
            of split files only).
        max_messages_per_tick: Messages received per tick, at most; more wait for the next.
        wait_time_seconds: Long-poll wait of each receive (0-20); a receive that comes back
            empty after it ends the tick.
        visibility_timeout_seconds: How long a received message stays hidden. A new object's
            message comes back after it and is deleted then; keep it above
            `max_receive_seconds` so a tick does not receive its own messages twice.
        max_receive_seconds: Receiving stops after this long (Dagster times a sensor
            evaluation out after 60 s).
        minimum_interval_seconds, default_status, description: passed to `dagster.sensor`.

    Raises:
        ValueError: the pipeline's partitions are not dynamic, its input is not on S3, or a
            limit is out of range.
    """
    partitions_def = dynamic_partitions_of(pipeline)
    input_spec, watched = _watched_s3_input(pipeline, glob)
    reads = QueueReads(
        queue_url=queue_url,
        max_messages=max_messages_per_tick,
        wait_time_seconds=wait_time_seconds,
        visibility_timeout_seconds=visibility_timeout_seconds,
        max_receive_seconds=max_receive_seconds,
    )
    output_key = pipeline.output_asset.key
    sensor_name = name or f"{output_key.to_python_identifier()}_sqs_arrivals"
    tags = {ARRIVAL_SENSOR_TAG: sensor_name, **(run_tags or {})}
    waiting = _WaitingMessages(visibility_timeout_seconds)

    def plan(context: dg.SensorEvaluationContext, files: list[ListedFile]) -> list[str]:
        if split is None:
            return [key for f in files if (key := watched.file_key(f.name))]
        lister = prefix_lister(context, watched.prefix, storage, resource_key, s3_resource_key)
        return _plan_split(context, files, watched, input_spec, split, lister)

    @dg.sensor(
        name=sensor_name,
        asset_selection=dg.AssetSelection.assets(output_key),
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        required_resource_keys={resource_key} | ({s3_resource_key} if s3_resource_key else set()),
        description=description
        or f"Registers objects announced on {queue_url} under {watched.prefix}{glob} as "
        f"partitions of {output_key.to_user_string()} and processes them",
    )
    def _sqs_arrival_sensor(
        context: dg.SensorEvaluationContext, **_resources: Any
    ) -> dg.SensorResult:
        started = time.perf_counter()
        known = registered_file_keys(
            context.instance.get_dynamic_partitions(partitions_def.name)  # type: ignore[arg-type]
        )
        receiving_from, settled = time.monotonic(), waiting.settled(known)
        client = sqs_client(queue_url, region=region, endpoint_url=endpoint_url)
        tick = receive_and_sort(context, client, reads, watched, known.__contains__, settled)
        waiting.remember(tick.in_flight, receiving_from)
        keys = plan(context, tick.new_files)
        cursor = _next_queue_cursor(context.cursor, tick, len(keys))
        summary = _tick_summary(tick, len(keys), time.perf_counter() - started, reads)
        context.log.info(summary)
        if not keys:
            return dg.SensorResult(skip_reason=summary, cursor=cursor)
        return dg.SensorResult(
            run_requests=arrival_requests(
                launch, sensor_name, output_key, partitions_def, keys, tags
            ),
            dynamic_partitions_requests=[partitions_def.build_add_request(keys)],
            cursor=cursor,
        )

    return _sqs_arrival_sensor


def receive_and_sort(
    context: dg.SensorEvaluationContext,
    client: Any,
    reads: QueueReads,
    watched: WatchedFiles,
    is_known: Callable[[str], bool],
    settled: list[str],
) -> QueueTick:
    """One tick's queue work: delete the `settled` messages of earlier ticks (first, so that
    none of them comes back during the receive), receive, sort, delete what is done with,
    log the poison."""
    refused = delete_messages(client, reads.queue_url, settled)
    messages, calls = receive_messages(client, reads)
    tick = sort_messages(messages, watched, is_known)
    tick.received, tick.receive_calls, tick.settled = len(messages), calls, len(settled)
    refused += delete_messages(client, reads.queue_url, tick.delete)
    tick.deleted = len(settled) + len(tick.delete) - len(refused)
    for message_id, why, body in tick.poison:
        context.log.warning(
            f"deleted poison message {message_id} from {reads.queue_url}: {why}; "
            f"the body starts {body!r}"
        )
    for why in refused:
        context.log.warning(f"SQS kept a message this tick deleted ({why}); a later tick will")
    return tick


def _next_queue_cursor(raw: str | None, tick: QueueTick, partitions: int) -> str:
    counts = parse_queue_cursor(raw)
    counts["received"] += tick.received
    counts["registered"] += partitions
    counts["deleted"] += tick.deleted
    counts["poison"] += len(tick.poison)
    return json.dumps({"v": QUEUE_CURSOR_VERSION, **counts})


def _watched_s3_input(pipeline: InferencePipeline, glob: str) -> tuple[InputSpec, WatchedFiles]:
    """The pipeline's input and the objects of it to watch; it must be on S3."""
    input_spec = InputSpec.model_validate(pipeline.spec["input"])
    watched = WatchedFiles(uri_template=input_spec.uri, glob=glob)
    if not watched.prefix.startswith("s3://") or "/" not in watched.prefix[len("s3://") :]:
        raise ValueError(
            f"sqs_arrival_sensor reads S3 event notifications; the input uri "
            f"{input_spec.uri!r} is not s3://bucket/prefix/{{partition_key}}...: "
            "use arrival_sensor for local files"
        )
    return input_spec, watched


class _WaitingMessages:
    """The messages the last tick left in flight, remembered by this code server process so
    that the next tick deletes them as soon as their partitions are registered, instead of
    receiving them again when their visibility timeout runs out.

    Only a shortcut: a process that restarted, or a receipt older than the visibility
    timeout, is forgotten and the message comes back; and nothing is deleted before the
    instance shows every partition it announced registered.
    """

    def __init__(self, visibility_timeout_seconds: int) -> None:
        # A receipt handle deletes while its message is hidden: up to the visibility timeout
        # after the receive, less a second for the delete call itself.
        self.max_age = visibility_timeout_seconds - 1
        self.received_from = 0.0
        self.messages: dict[str, tuple[str, tuple[str, ...]]] = {}

    def settled(self, known: Collection[str]) -> list[str]:
        """Receipt handles of the remembered messages whose partitions are all registered
        now; the rest are forgotten (their tick's result was never applied)."""
        fresh = time.monotonic() - self.received_from < self.max_age
        handles = [
            handle
            for handle, keys in self.messages.values()
            if fresh and all(key in known for key in keys)
        ]
        self.messages = {}
        return handles

    def remember(
        self, in_flight: Mapping[str, tuple[str, tuple[str, ...]]], received_from: float
    ) -> None:
        """Remember a tick's messages left in flight, received at `received_from` or later."""
        self.messages = dict(in_flight)
        self.received_from = received_from


def _check_reads(reads: QueueReads) -> None:
    if reads.max_messages < 1:
        raise ValueError("max_messages_per_tick must be at least 1")
    if not 0 <= reads.wait_time_seconds <= 20:
        raise ValueError("wait_time_seconds must be 0 to 20 (SQS's long-poll limit)")
    if not 1 <= reads.visibility_timeout_seconds <= 43_200:
        raise ValueError("visibility_timeout_seconds must be 1 to 43200 (SQS's limits)")
    if reads.max_receive_seconds <= 0:
        raise ValueError("max_receive_seconds must be positive")


def _plan_split(
    context: dg.SensorEvaluationContext,
    files: list[ListedFile],
    watched: WatchedFiles,
    input_spec: InputSpec,
    split: SplitLargeFiles,
    lister: Any,
) -> list[str]:
    """Partition keys of new files, split into ranges; a file whose footer cannot be read
    is left for its message's next delivery (an object deleted since: the redrive policy)."""
    keys: list[str] = []
    for listed in files:
        try:
            keys += plan_partition_keys(
                [listed], watched, input_spec.resolved_format(), split, lister
            )
        except (OSError, ValueError) as exc:  # gone, unreadable, not Parquet (ArrowInvalid)
            context.log.warning(
                f"could not read {watched.prefix}{listed.name} to split it ({exc}); its "
                "message stays on the queue and is tried again when it comes back"
            )
    return keys


def _tick_summary(tick: QueueTick, partitions: int, seconds: float, reads: QueueReads) -> str:
    """One line on what a tick received and did."""
    return (
        f"received {tick.received} message(s) in {tick.receive_calls} receive(s) in "
        f"{seconds:.2f}s: "
        f"{len(tick.new_files)} new file(s), {partitions} partition(s); deleted "
        f"{tick.duplicates} of registered objects, {tick.not_arrivals} test or non-create "
        f"event(s), {len(tick.poison)} poison, {tick.settled} of objects registered since "
        f"the last tick; {len(tick.in_flight)} left in flight until their partitions are "
        f"registered (deleted by the next tick, or back on the queue after "
        f"{reads.visibility_timeout_seconds}s)"
    )
