package bpf

// Protocol limits, re-exported from the C header's `enum limit` under Go names.
const (
	Version     = uint8(XdpaggLimitLIMIT_VERSION)
	DefaultPort = uint16(XdpaggLimitLIMIT_DEFAULT_PORT)
	// MaxValues is the number of 32-bit values one packet carries (K).
	MaxValues = int(XdpaggLimitLIMIT_MAX_VALUES)
	// MaxWorkers is the number of workers one job can have at one aggregation level.
	MaxWorkers = int(XdpaggLimitLIMIT_MAX_WORKERS)
	// HdrSize is the size of the xdpagg header on the wire.
	HdrSize = int(XdpaggLimitLIMIT_HDR_SIZE)
)
