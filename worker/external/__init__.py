"""The external KV tier's worker side: where blocks are saved to and read back from
(a disk directory, a Mooncake Store), and the thread that moves them off the step path."""
