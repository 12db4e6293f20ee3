"""S3 event notifications, as SQS delivers them, read into the objects they announce.

No Dagster and no AWS client here: `read_s3_event` takes one SQS message body and says what
it is. The SQS arrival sensor (`sqs_sensor.py`) is the layer above.

The shapes read (https://docs.aws.amazon.com/AmazonS3/latest/userguide/notification-content-structure.html):

- An event: `{"Records": [{"eventSource": "aws:s3", "eventName": "ObjectCreated:Put",
  "s3": {"bucket": {"name": ...}, "object": {"key": ..., "size": ...}}}]}`. Object keys
  arrive URL-encoded (`a+b%2Cc` is `a b,c`), as S3 writes them.
- The test event S3 sends when a notification is configured:
  `{"Service": "Amazon S3", "Event": "s3:TestEvent", ...}`.
- Either of them inside an SNS envelope (`{"Type": "Notification", "Message": "<json>"}`),
  for a bucket that notifies an SNS topic the queue subscribes to without raw delivery.

Anything else is poison (`PoisonMessage`): no retry will make it an S3 event.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote_plus

CREATED_PREFIX = "ObjectCreated:"


class PoisonMessage(ValueError):
    """A message that is not, and never will be, an S3 event notification."""


@dataclass(frozen=True)
class CreatedObject:
    """One `ObjectCreated:*` record: the object's bucket, decoded key and size in bytes."""

    bucket: str
    key: str
    size: int


@dataclass
class S3Event:
    """What one message announces.

    Attributes:
        created: The objects created (`ObjectCreated:*` records), in record order.
        other_records: How many records announce something else (`ObjectRemoved:*`,
            restores, replication): not arrivals.
        is_test_event: The `s3:TestEvent` S3 sends when the notification is set up.
    """

    created: list[CreatedObject] = field(default_factory=list)
    other_records: int = 0
    is_test_event: bool = False


def read_s3_event(body: str) -> S3Event:
    """The S3 event an SQS message body holds.

    Raises:
        PoisonMessage: the body is not JSON, not an S3 event (or a test event), or a record
            lacks its bucket name or object key; the message says which.
    """
    try:
        message = json.loads(body)
    except ValueError as exc:
        raise PoisonMessage(f"the body is not JSON ({exc.msg} at character {exc.pos})") from None
    if isinstance(message, dict) and message.get("Type") == "Notification":
        inner = message.get("Message")
        if not isinstance(inner, str):
            raise PoisonMessage("an SNS notification without a Message string")
        return read_s3_event(inner)
    if not isinstance(message, dict):
        raise PoisonMessage(f"the body is JSON {type(message).__name__}, not an S3 event object")
    if message.get("Event") == "s3:TestEvent":
        return S3Event(is_test_event=True)
    records = message.get("Records")
    if not isinstance(records, list) or not records:
        raise PoisonMessage(
            "the body has no Records list: not an S3 event notification "
            f"(top-level fields: {sorted(message)[:8]})"
        )
    event = S3Event()
    for number, record in enumerate(records):
        created = _created_object(record, number)
        if created is None:
            event.other_records += 1
        else:
            event.created.append(created)
    return event


def _created_object(record: Any, number: int) -> CreatedObject | None:
    """The object an `ObjectCreated:*` record announces; None for other S3 events."""
    if not isinstance(record, dict) or record.get("eventSource") not in (None, "aws:s3"):
        raise PoisonMessage(f"record {number} is not an S3 event record")
    name = record.get("eventName")
    if not isinstance(name, str):
        raise PoisonMessage(f"record {number} has no eventName")
    if not name.startswith(CREATED_PREFIX):
        return None
    s3 = record.get("s3")
    bucket = s3.get("bucket", {}).get("name") if isinstance(s3, dict) else None
    obj = s3.get("object") if isinstance(s3, dict) else None
    key = obj.get("key") if isinstance(obj, dict) else None
    if not isinstance(bucket, str) or not isinstance(key, str) or not bucket or not key:
        raise PoisonMessage(f"record {number} ({name}) lacks s3.bucket.name or s3.object.key")
    size = obj.get("size", 0)
    return CreatedObject(bucket=bucket, key=unquote_plus(key), size=size if _is_size(size) else 0)


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
