package bpf

// Protocol limits, re-exported from the C header's `enum limit` under Go names.
const (
	Version     = uint8(XdpaggLimitLIMIT_VERSION)
	DefaultPort = uint16(XdpaggLimitLIMIT_DEFAULT_PORT)
	// MaxValues is the most 32-bit values one packet may carry (at an MTU of 3388 or more).
	MaxValues = int(XdpaggLimitLIMIT_MAX_VALUES)
	// StdValues is how many values fill a packet at the standard 1500-byte MTU (K).
	StdValues = int(XdpaggLimitLIMIT_STD_VALUES)
	// MaxWorkers is the number of workers one job can have at one aggregation level.
	MaxWorkers = int(XdpaggLimitLIMIT_MAX_WORKERS)
	// HdrSize is the size of the xdpagg header on the wire.
	HdrSize = int(XdpaggLimitLIMIT_HDR_SIZE)
	// RegSlots is the compiled size of a register array: the most slots per array (r).
	RegSlots = uint32(XdpaggLimitLIMIT_REG_SLOTS)
	// JobMaxArrays is the most register arrays (m) one sparse job may own.
	JobMaxArrays = uint32(XdpaggLimitLIMIT_JOB_MAX_ARRAYS)
	// SparseMaxPasses bounds the passes (1 + recirculations) of one hot packet.
	SparseMaxPasses = int(XdpaggLimitLIMIT_SPARSE_MAX_PASSES)
)

// ValuesForMTU is how many values fill one packet at an IPv4 MTU: (MTU - 20 IPv4 - 8 UDP - 32
// header) / 4, capped at MaxValues.
func ValuesForMTU(mtu int) int {
	return max(0, min(MaxValues, (mtu-20-8-HdrSize)/4))
}
