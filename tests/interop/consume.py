"""A consumer nobody at warren wrote: reads CloudEvents with the CloudEvents SDK.

    consume.py AMQP_URL QUEUE COUNT

Takes COUNT messages from QUEUE with pika, without acking them (they go back
to the queue when the connection closes), and reads each with the SDK's
RabbitMQ binding, `from_rabbitmq`, which tells binary mode from structured by
the content type. Prints one JSON object per event: its attributes (time in
RFC 3339), the data, and the AMQP message_id it came with; a message that is
no CloudEvent in either mode (no structured content type, no ce-specversion
header) as null attributes. Exits non-zero if a message is missing or the SDK
refuses a CloudEvent.
"""

import json
import sys
import time

import pika
from cloudevents.core.bindings.rabbitmq import RabbitMQMessage, from_rabbitmq
from cloudevents.core.formats.json import JSONFormat

URL, QUEUE, COUNT = sys.argv[1], sys.argv[2], int(sys.argv[3])

connection = pika.BlockingConnection(pika.URLParameters(URL))
channel = connection.channel()
taken = 0
deadline = time.monotonic() + 30
while taken < COUNT:
    method, properties, body = channel.basic_get(QUEUE, auto_ack=False)
    if method is None:
        if time.monotonic() > deadline:
            sys.exit(f"only {taken} of {COUNT} messages in {QUEUE}")
        time.sleep(0.05)
        continue
    taken += 1
    headers = properties.headers or {}
    structured = (properties.content_type or "").startswith("application/cloudevents")
    if not structured and "ce-specversion" not in headers:
        print(json.dumps({"attributes": None, "message_id": properties.message_id}), flush=True)
        continue
    message = RabbitMQMessage(
        headers=dict(headers),
        content_type=properties.content_type,
        body=body,
    )
    event = from_rabbitmq(message, JSONFormat())
    attributes = {
        name: value.isoformat() if hasattr(value, "isoformat") else value
        for name, value in event.get_attributes().items()
    }
    print(json.dumps({
        "attributes": attributes,
        "data": event.get_data(),
        "message_id": properties.message_id,
    }), flush=True)
connection.close()
