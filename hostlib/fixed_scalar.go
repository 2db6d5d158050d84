//go:build !(goexperiment.simd && amd64)

package hostlib

// Without GOEXPERIMENT=simd (or off amd64) the codec is the scalar one.

// SIMDCodec reports whether quantisation and dequantisation run on SIMD instructions (a build
// with GOEXPERIMENT=simd on an amd64 CPU with AVX2).
func SIMDCodec() bool { return false }

func quantizeTo(out []byte, vals []float32, scaleLog2 uint8) bool {
	return quantizeToScalar(out, vals, scaleLog2)
}

func dequantizeFrom(dst []float32, in []byte, scaleLog2 uint8) {
	dequantizeFromScalar(dst, in, scaleLog2)
}
