CREATE INDEX warren_outbox_failed ON warren_outbox (id) WHERE failed_at IS NOT NULL;

CREATE INDEX warren_redeliveries_age ON warren_redeliveries (consumer_name, last_delivered_at);
