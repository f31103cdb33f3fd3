-- The W3C trace context each outbox row continues, captured when the row is
-- written (a relay pass mixes rows of many handlers), and the message whose
-- handler wrote it, for `warren trace`. A row written before this migration
-- has none and publishes as it did.
ALTER TABLE warren_outbox
    ADD COLUMN causation_id VARBINARY(255) NULL,
    ADD COLUMN traceparent  VARCHAR(55)    CHARACTER SET ascii NULL,
    ADD COLUMN tracestate   TEXT           CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    ADD COLUMN baggage      TEXT           CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    ADD INDEX warren_outbox_causation (causation_id);
