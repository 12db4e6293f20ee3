"""The SQS arrival sensor: S3 event notifications on a queue (moto's SQS on the loopback
server) become dynamic partitions, each object once, with no bucket listing; a message is
deleted only once its partition is registered; poison is logged and deleted.

The sensor is evaluated with `build_sensor_context` on a real Dagster instance; the test's
`QueueSensorDriver` then applies the result as the sensor daemon does (partitions first).
Every S3 and SQS request goes through a recording proxy (`request_log.py`), which counts
the bucket listings.
"""

from __future__ import annotations

import itertools
import json
import logging
import time

import dagster as dg
import pytest
from request_log import RequestLog

from dagster_gpuinfer import GpuInferenceResource, InputSpec, inference_assets
from dagster_gpuinfer.s3_events import PoisonMessage, read_s3_event
from dagster_gpuinfer.sensors import arrival_sensor
from dagster_gpuinfer.sqs_sensor import region_of_queue_url, sqs_arrival_sensor

_names = itertools.count()


@pytest.fixture(scope="module")
def instance():
    with dg.instance_for_test() as test_instance:
        yield test_instance


@pytest.fixture(scope="module")
def proxy(s3_server):
    """The recording proxy in front of the loopback server, and a fast clock for moto's SQS.

    moto 5.2.5's SQS recomputes the queue's attributes, scanning every message with two
    datetime-based clock reads, for each message it sends or receives: a queue of 1,000
    messages costs about 0.2 s per message received. Its clock helpers are swapped for
    `time.time()`, the same value (seconds since the epoch) without the datetime work;
    what the queue does is unchanged.
    """
    import moto.sqs.models as sqs_models

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sqs_models, "unix_time", lambda dt=None: time.time())
        patch.setattr(sqs_models, "unix_time_millis", lambda dt=None: time.time() * 1000.0)
        log = RequestLog(s3_server.endpoint_url)
        yield log
        log.close()


@pytest.fixture
def sqs(proxy, s3_server):
    import boto3

    return boto3.client("sqs", endpoint_url=s3_server.endpoint_url, region_name=s3_server.region)


def new_queue(sqs) -> str:
    return sqs.create_queue(QueueName=f"arrivals-{next(_names)}")["QueueUrl"]


def queue_depth(sqs, queue_url: str) -> tuple[int, int]:
    """(visible, in flight) messages."""
    attributes = sqs.get_queue_attributes(
        QueueUrl=queue_url,
        AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
    )["Attributes"]
    return (
        int(attributes["ApproximateNumberOfMessages"]),
        int(attributes["ApproximateNumberOfMessagesNotVisible"]),
    )


def s3_event(bucket: str, key: str, size: int = 3, name: str = "ObjectCreated:Put") -> str:
    """An S3 event notification body as S3 writes it (the key URL-encoded)."""
    from urllib.parse import quote_plus

    record = {
        "eventVersion": "2.1",
        "eventSource": "aws:s3",
        "awsRegion": "us-east-1",
        "eventName": name,
        "s3": {
            "s3SchemaVersion": "1.0",
            "bucket": {"name": bucket, "arn": f"arn:aws:s3:::{bucket}"},
            "object": {"key": quote_plus(key), "size": size},
        },
    }
    return json.dumps({"Records": [record]})


def send_bodies(sqs, queue_url: str, bodies: list[str]) -> list[str]:
    """Send the bodies, 10 a call; their message ids, in order."""
    ids: list[str] = []
    for start in range(0, len(bodies), 10):
        entries = [
            {"Id": str(i), "MessageBody": body} for i, body in enumerate(bodies[start : start + 10])
        ]
        response = sqs.send_message_batch(QueueUrl=queue_url, Entries=entries)
        assert not response.get("Failed")
        sent = {item["Id"]: item["MessageId"] for item in response["Successful"]}
        ids += [sent[entry["Id"]] for entry in entries]
    return ids


def make_pipeline(bucket: str, glob_suffix: str = ".jsonl"):
    return inference_assets(
        name="queued_embeddings",
        model="/models/never-loaded",
        task="embed",
        input=InputSpec(uri=f"s3://{bucket}/in/{{partition_key}}{glob_suffix}", id_column="id"),
        output_root="/tmp/unused-output",
        partitions_def=dg.DynamicPartitionsDefinition(name=f"queued_files_{next(_names)}"),
    )


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelno, record.getMessage()))


class QueueSensorDriver:
    """Evaluates the sensor and, unless told the daemon died, applies its result as the
    sensor daemon does: partitions registered, then the cursor saved."""

    def __init__(self, pipeline, instance, proxy: RequestLog, queue_url: str, **kwargs):
        kwargs.setdefault("visibility_timeout_seconds", 30)
        kwargs.setdefault("wait_time_seconds", 0)
        self.sensor = sqs_arrival_sensor(
            pipeline, queue_url=queue_url, endpoint_url=proxy.endpoint_url, **kwargs
        )
        self.partitions_name = pipeline.output_asset.partitions_def.name
        self.instance = instance
        self.gpu = GpuInferenceResource(
            s3_endpoint_url=proxy.endpoint_url, s3_region="us-east-1", s3_allow_http=True
        )
        self.cursor: str | None = None
        self.log = _Lines()

    def evaluate(self) -> dg.SensorResult:
        context = dg.build_sensor_context(
            instance=self.instance, cursor=self.cursor, resources={"gpu": self.gpu}
        )
        context.log.addHandler(self.log)
        result = self.sensor(context)
        assert isinstance(result, dg.SensorResult)
        return result

    def tick(self) -> dg.SensorResult:
        result = self.evaluate()
        for request in result.dynamic_partitions_requests or []:
            self.instance.add_dynamic_partitions(
                request.partitions_def_name, request.partition_keys
            )
        self.cursor = result.cursor
        return result

    def registered(self) -> list[str]:
        return list(self.instance.get_dynamic_partitions(self.partitions_name))

    def warnings(self) -> list[str]:
        return [line for level, line in self.log.lines if level >= logging.WARNING]


def added_keys(result: dg.SensorResult) -> list[str]:
    return [k for r in result.dynamic_partitions_requests or [] for k in r.partition_keys]


def requested_keys(result: dg.SensorResult, pipeline) -> list[str]:
    keys: list[str] = []
    for request in result.run_requests or []:
        subset = request.asset_graph_subset
        keys += subset.get_partitions_subset(pipeline.output_asset.key).get_partition_keys()
    return keys


def drain(driver: QueueSensorDriver, sqs, queue_url: str, max_ticks: int = 50) -> list[str]:
    """Tick until the queue holds nothing (waiting out visibility timeouts); the keys added."""
    added: list[str] = []
    for _ in range(max_ticks):
        added += added_keys(driver.tick())
        if queue_depth(sqs, queue_url) == (0, 0):
            return added
        if queue_depth(sqs, queue_url)[0] == 0:
            time.sleep(0.5)
    raise AssertionError(f"not drained in {max_ticks} ticks: {queue_depth(sqs, queue_url)}")


# --------------------------------------------------------------------------- messages


def test_s3_event_bodies_are_read_into_created_objects_with_decoded_keys():
    event = read_s3_event(s3_event("bkt", "in/2026 11/a,b+c.jsonl", size=42))
    assert [(o.bucket, o.key, o.size) for o in event.created] == [
        ("bkt", "in/2026 11/a,b+c.jsonl", 42)
    ]
    removed = read_s3_event(s3_event("bkt", "in/a.jsonl", name="ObjectRemoved:Delete"))
    assert removed.created == [] and removed.other_records == 1
    test = read_s3_event(json.dumps({"Service": "Amazon S3", "Event": "s3:TestEvent"}))
    assert test.is_test_event and test.created == []
    wrapped = json.dumps({"Type": "Notification", "Message": s3_event("bkt", "in/x.jsonl")})
    assert [o.key for o in read_s3_event(wrapped).created] == ["in/x.jsonl"]


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ("not json {", "not JSON"),
        ("[1, 2]", "JSON list"),
        ('{"hello": "world"}', "no Records list"),
        ('{"Records": [{"eventName": "ObjectCreated:Put", "s3": {}}]}', "lacks s3.bucket.name"),
        ('{"Records": [{"eventSource": "aws:sqs", "eventName": "x"}]}', "not an S3 event"),
    ],
)
def test_bodies_that_are_no_s3_event_are_poison_with_the_reason(body, why):
    with pytest.raises(PoisonMessage, match=why):
        read_s3_event(body)


def test_queue_region_comes_from_its_url():
    assert region_of_queue_url("https://sqs.eu-west-1.amazonaws.com/1234/q") == "eu-west-1"
    assert region_of_queue_url("https://ap-south-1.queue.amazonaws.com/1234/q") == "ap-south-1"
    assert region_of_queue_url("http://127.0.0.1:4566/000000000000/q") is None


def test_the_sensor_refuses_an_input_that_is_not_on_s3(tmp_path):
    pipeline = inference_assets(
        name="local_docs",
        model="/models/x",
        task="embed",
        input=InputSpec(uri=f"{tmp_path}/{{partition_key}}.jsonl"),
        output_root=str(tmp_path / "out"),
        partitions_def=dg.DynamicPartitionsDefinition(name="local_docs"),
    )
    with pytest.raises(ValueError, match="use arrival_sensor for local files"):
        sqs_arrival_sensor(pipeline, queue_url="https://sqs.us-east-1.amazonaws.com/1/q")


# --------------------------------------------------------------------------- real notifications


def test_bucket_notifications_register_each_object_once_without_listing_the_bucket(
    s3_server, sqs, proxy, instance
):
    bucket = s3_server.new_bucket("notified")
    queue_url = new_queue(sqs)
    arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])
    s3_server.client.put_bucket_notification_configuration(
        Bucket=bucket,
        NotificationConfiguration={
            "QueueConfigurations": [
                {"QueueArn": arn["Attributes"]["QueueArn"], "Events": ["s3:ObjectCreated:*"]}
            ]
        },
    )  # moto, like S3, sends an s3:TestEvent message now
    names = [f"batch/{i:03d}" for i in range(30)] + ["with space, and+plus"]
    for name in names:
        s3_server.client.put_object(Bucket=bucket, Key=f"in/{name}.jsonl", Body=b"{}\n")
    s3_server.client.put_object(Bucket=bucket, Key="elsewhere/z.jsonl", Body=b"{}\n")
    pipeline = make_pipeline(bucket)
    driver = QueueSensorDriver(pipeline, instance, proxy, queue_url)

    first = driver.tick()
    assert sorted(added_keys(first)) == sorted(names)
    [request] = first.run_requests
    assert sorted(requested_keys(first, pipeline)) == sorted(names)
    assert request.tags["dagster-gpuinfer/arrival_sensor"] == "queued_embeddings_sqs_arrivals"
    # The test event and the object outside the prefix are deleted; the new objects' messages
    # wait in flight until their partitions are registered.
    assert queue_depth(sqs, queue_url) == (0, len(names))
    assert any("elsewhere/z.jsonl is outside" in line for line in driver.warnings())

    assert drain(driver, sqs, queue_url) == []  # registered now: deleted by the next tick
    assert sorted(driver.registered()) == sorted(names)
    assert json.loads(driver.cursor) == {
        "v": 1,
        "received": len(names) + 2,
        "registered": len(names),
        "deleted": len(names) + 2,
        "poison": 1,
    }
    assert proxy.s3_listings(bucket) == 0

    # The counter counts: the listing sensor, through the same proxy, lists the bucket.
    lister = arrival_sensor(pipeline, name="listing_control")
    gpu = GpuInferenceResource(
        s3_endpoint_url=proxy.endpoint_url, s3_region="us-east-1", s3_allow_http=True
    )
    lister(dg.build_sensor_context(instance=instance, resources={"gpu": gpu}))
    assert proxy.s3_listings(bucket) >= 1


def test_a_large_jsonl_object_splits_by_the_size_in_its_event_without_an_s3_request(
    s3_server, sqs, proxy, instance
):
    from dagster_gpuinfer.arrivals import SplitLargeFiles, byte_ranges

    bucket = s3_server.new_bucket("sized")
    queue_url = new_queue(sqs)
    send_bodies(sqs, queue_url, [s3_event(bucket, "in/big.jsonl", size=10_000)])
    s3_before = [r for r in proxy.requests if r.sqs_action is None]
    split = SplitLargeFiles(min_bytes=4096, jsonl_bytes_per_partition=3000)
    driver = QueueSensorDriver(make_pipeline(bucket), instance, proxy, queue_url, split=split)
    assert added_keys(driver.tick()) == [f"big@bytes={a}-{b}" for a, b in byte_ranges(10_000, 3000)]
    assert [r for r in proxy.requests if r.sqs_action is None] == s3_before  # no S3 at all


# --------------------------------------------------------------------------- failures


def test_a_tick_that_dies_before_registration_leaves_its_messages_to_come_back(
    s3_server, sqs, proxy, instance
):
    bucket = s3_server.new_bucket("dies")
    queue_url = new_queue(sqs)
    names = [f"f{i:02d}" for i in range(12)]
    send_bodies(sqs, queue_url, [s3_event(bucket, f"in/{n}.jsonl") for n in names])
    pipeline = make_pipeline(bucket)
    driver = QueueSensorDriver(pipeline, instance, proxy, queue_url, visibility_timeout_seconds=2)

    # The evaluation received every message and asked for the partitions; then the daemon
    # died (or the evaluation timed out) before registering them: nothing was deleted.
    died = driver.evaluate()
    assert sorted(added_keys(died)) == names
    assert driver.registered() == []
    assert queue_depth(sqs, queue_url) == (0, len(names))
    deletes_before = proxy.sqs_calls("DeleteMessageBatch")
    assert added_keys(driver.tick()) == []  # still hidden: nothing to do yet
    assert proxy.sqs_calls("DeleteMessageBatch") == deletes_before

    time.sleep(2.2)  # the visibility timeout runs out; the messages are back
    assert queue_depth(sqs, queue_url) == (len(names), 0)
    assert sorted(added_keys(driver.tick())) == names
    assert queue_depth(sqs, queue_url) == (0, len(names))  # kept until registered

    # A new code server process knows no receipts: the messages come back, their objects
    # are registered, and they are deleted then, with nothing requested again.
    restarted = QueueSensorDriver(
        pipeline, instance, proxy, queue_url, visibility_timeout_seconds=2
    )
    restarted.cursor = driver.cursor
    assert added_keys(restarted.tick()) == []
    assert queue_depth(sqs, queue_url) == (0, len(names))
    time.sleep(2.2)
    result = restarted.tick()
    assert added_keys(result) == [] and not result.run_requests
    assert queue_depth(sqs, queue_url) == (0, 0)
    assert sorted(restarted.registered()) == names
    # Counted: the tick that registered and the restarted one (the dead tick's cursor was
    # never saved).
    assert json.loads(restarted.cursor)["received"] == 2 * len(names)


def test_poison_messages_are_logged_by_id_and_deleted_without_failing_the_tick(
    s3_server, sqs, proxy, instance
):
    bucket = s3_server.new_bucket("poison")
    queue_url = new_queue(sqs)
    poison = {
        "not json": "this is not json",
        "no event": json.dumps({"hello": "world"}),
        "other bucket": s3_event("some-other-bucket", "in/a.jsonl"),
        "other prefix": s3_event(bucket, "out/a.jsonl"),
        "other suffix": s3_event(bucket, "in/a.parquet"),
        "marker": s3_event(bucket, "in/_SUCCESS.jsonl"),
        "bad key": s3_event(bucket, "in/wait...what.jsonl"),
    }
    good = [s3_event(bucket, "in/good-1.jsonl"), s3_event(bucket, "in/good-2.jsonl")]
    removal = s3_event(bucket, "in/gone.jsonl", name="ObjectRemoved:Delete")
    ids = send_bodies(sqs, queue_url, [*poison.values(), good[0], removal, good[1]])
    driver = QueueSensorDriver(make_pipeline(bucket), instance, proxy, queue_url)

    first = driver.tick()
    assert sorted(added_keys(first)) == ["good-1", "good-2"]
    warnings = driver.warnings()
    assert len(warnings) == len(poison)
    for message_id, why in zip(ids, poison, strict=False):
        [line] = [w for w in warnings if message_id in w]
        assert line.startswith(f"deleted poison message {message_id} from {queue_url}: "), why
    assert "the body is not JSON" in warnings[0] and "'this is not json'" in warnings[0]
    assert "no Records list" in warnings[1]
    assert "outside the pipeline's input prefix" in warnings[2] and "outside" in warnings[3]
    assert "must end in '.jsonl'" in warnings[4] and "not start with '.' or '_'" in warnings[5]
    assert "cannot be a partition" in warnings[6] and "'...'" in warnings[6]
    # Poison and the removal are gone; only the new objects' messages wait, in flight.
    assert queue_depth(sqs, queue_url) == (0, 2)
    assert drain(driver, sqs, queue_url) == []
    assert sorted(driver.registered()) == ["good-1", "good-2"]


# --------------------------------------------------------------------------- scale


def deliver_and_register(n: int, s3_server, sqs, proxy, instance, wave: int) -> None:
    """n objects announced with a fifth of them twice, in shuffled order, `wave` messages
    sent between ticks; checks each object is added and requested exactly once, with no
    listing, and the queue left empty."""
    import random

    bucket = s3_server.new_bucket("scale")
    queue_url = new_queue(sqs)
    names = [f"day-{i % 7}/file-{i:05d}" for i in range(n)]
    bodies = [s3_event(bucket, f"in/{name}.jsonl", size=100 + i) for i, name in enumerate(names)]
    rng = random.Random(38)
    stream = bodies + rng.sample(bodies, n // 5)  # duplicate deliveries
    rng.shuffle(stream)  # out of order: a duplicate may come first, or after the deletion
    pipeline = make_pipeline(bucket)
    driver = QueueSensorDriver(
        pipeline,
        instance,
        proxy,
        queue_url,
        max_messages_per_tick=4 * wave,
        visibility_timeout_seconds=20,
    )
    added: list[str] = []
    requested: list[str] = []
    receives_before = proxy.sqs_calls("ReceiveMessage")
    for start in range(0, len(stream), wave):
        send_bodies(sqs, queue_url, stream[start : start + wave])
        result = driver.tick()
        added += added_keys(result)
        requested += requested_keys(result, pipeline)
    added += drain(driver, sqs, queue_url)
    assert len(added) == n and sorted(added) == sorted(names)
    assert len(requested) == n and sorted(requested) == sorted(names)
    assert sorted(driver.registered()) == sorted(names)
    assert proxy.s3_listings(bucket) == 0
    counts = json.loads(driver.cursor)
    assert counts["registered"] == n and counts["deleted"] == len(stream)
    # Messages come 10 a receive (plus one receive that finds nothing per tick).
    receives = proxy.sqs_calls("ReceiveMessage") - receives_before
    assert counts["received"] >= len(stream)
    assert receives <= counts["received"] / 5


def test_500_arrivals_with_duplicates_out_of_order_register_once_without_listing(
    s3_server, sqs, proxy, instance
):
    deliver_and_register(500, s3_server, sqs, proxy, instance, wave=100)


@pytest.mark.slow
def test_10000_arrivals_with_duplicates_out_of_order_register_once_without_listing(
    s3_server, sqs, proxy, instance
):
    """About 30 s of CPU, most of it moto's SQS: 29 s on an idle 2-core machine, 99 s at
    a load average of 17."""
    deliver_and_register(10_000, s3_server, sqs, proxy, instance, wave=250)


# --------------------------------------------------------------------------- real daemon


def test_sensor_daemon_registers_then_a_later_tick_deletes_the_messages(
    s3_server, sqs, proxy, tmp_path, monkeypatch
):
    from daemon_workspace import daemon_workspace, tick_sensors
    from dagster._core.execution.backfill import BulkActionsFilter

    bucket = s3_server.new_bucket("daemon")
    queue_url = new_queue(sqs)
    names = ["p1", "p2", "p3"]
    send_bodies(sqs, queue_url, [s3_event(bucket, f"in/{n}.jsonl") for n in [*names, "p2"]])
    monkeypatch.setenv("GPUINFER_TEST_INPUT_URI", f"s3://{bucket}/in/{{partition_key}}.jsonl")
    monkeypatch.setenv("GPUINFER_TEST_OUTPUT_ROOT", str(tmp_path / "out"))
    monkeypatch.setenv("GPUINFER_TEST_S3_ENDPOINT", proxy.endpoint_url)
    monkeypatch.setenv("GPUINFER_TEST_SQS_QUEUE_URL", queue_url)
    with dg.instance_for_test() as test_instance, daemon_workspace(test_instance) as workspace:
        tick_sensors(workspace)
        assert sorted(test_instance.get_dynamic_partitions("doc_files")) == names
        [backfill] = test_instance.get_backfills(filters=BulkActionsFilter())
        subset = backfill.asset_backfill_data.target_subset
        keys = subset.get_partitions_subset(dg.AssetKey("doc_vectors")).get_partition_keys()
        assert sorted(keys) == names
        assert backfill.tags["dagster-gpuinfer/arrival_sensor"] == "doc_vectors_sqs_arrivals"
        assert queue_depth(sqs, queue_url) == (0, 4)  # registered after the tick: kept

        time.sleep(1.1)  # the sensor's interval: the next tick deletes by the kept receipts
        tick_sensors(workspace)
        assert queue_depth(sqs, queue_url) == (0, 0)
        assert len(test_instance.get_backfills(filters=BulkActionsFilter())) == 1
    assert proxy.s3_listings(bucket) == 0


# --------------------------------------------------------------------------- YAML


def queue_yaml(bucket: str, queue_url: str, endpoint: str) -> str:
    return f"""
name: queued_tickets
model: /models/minilm
task: embed
input:
  uri: s3://{bucket}/in/{{partition_key}}.jsonl
  id_column: ticket_id
output_root: s3://{bucket}/out
partitioning:
  type: dynamic
arrival_sensor:
  glob: "*.jsonl"
  launch: runs
  sqs:
    queue_url: {queue_url}
    endpoint_url: {endpoint}
    region: us-east-1
    wait_time_seconds: 0
    visibility_timeout_seconds: 5
"""


def test_a_yaml_pipeline_with_an_sqs_block_gets_the_queue_sensor(s3_server, sqs, proxy, instance):
    from dagster_gpuinfer.components import InferencePipelineComponent

    bucket = s3_server.new_bucket("yaml")
    queue_url = new_queue(sqs)
    send_bodies(
        sqs, queue_url, [s3_event(bucket, "in/t-1.jsonl"), s3_event(bucket, "in/t-2.jsonl")]
    )
    text = queue_yaml(bucket, queue_url, proxy.endpoint_url)
    gpu = GpuInferenceResource()
    defs = dg.component_defs(
        component=InferencePipelineComponent.resolve_from_yaml(text), resources={"gpu": gpu}
    )
    [sensor] = defs.sensors
    assert sensor.name == "queued_tickets_sqs_arrivals"
    result = sensor(dg.build_sensor_context(instance=instance, resources={"gpu": gpu}))
    assert [(r.partition_key, r.run_key) for r in result.run_requests] == [
        ("t-1", "queued_tickets_sqs_arrivals:t-1"),
        ("t-2", "queued_tickets_sqs_arrivals:t-2"),
    ]
    assert queue_depth(sqs, queue_url) == (0, 2)  # not registered yet: kept in flight

    local = text.replace(f"s3://{bucket}/in/", "/tmp/local-in/")
    with pytest.raises(dg.DagsterInvalidDefinitionError, match="arrival_sensor: .*local files"):
        dg.component_defs(
            component=InferencePipelineComponent.resolve_from_yaml(local), resources={"gpu": gpu}
        )
