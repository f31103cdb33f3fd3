-- The W3C trace context each outbox row continues, captured when the row is
-- written (a relay pass mixes rows of many handlers), and the message whose
-- handler wrote it, for `warren trace`. A row written before this migration
-- has none and publishes as it did.
ALTER TABLE warren_outbox ADD COLUMN causation_id TEXT NULL;
ALTER TABLE warren_outbox ADD COLUMN traceparent TEXT NULL;
ALTER TABLE warren_outbox ADD COLUMN tracestate TEXT NULL;
ALTER TABLE warren_outbox ADD COLUMN baggage TEXT NULL;

CREATE INDEX warren_outbox_causation ON warren_outbox (causation_id)
    WHERE causation_id IS NOT NULL;
