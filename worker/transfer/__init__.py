"""P/D disaggregation's worker side: a prefill worker serves lent blocks, a decode worker pulls them (docs/pd-disaggregation.md)."""
