package ctlauth

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/hkdf"
	"crypto/sha256"
	"fmt"
)

// AEAD returns AES-256-GCM (Go's standard library) under a key derived from key with
// HKDF-SHA256 and info. Each purpose of one key (the management channel's two directions, the
// heartbeat answers) names its own info, so a message sealed for one never opens as another.
func AEAD(key []byte, info string) (cipher.AEAD, error) {
	if len(key) != KeySize {
		return nil, fmt.Errorf("%w: %d bytes, want %d", ErrBadKey, len(key), KeySize)
	}
	k, err := hkdf.Key(sha256.New, key, nil, info, 32)
	if err != nil {
		return nil, fmt.Errorf("derive %q key: %w", info, err)
	}
	b, err := aes.NewCipher(k)
	if err != nil {
		return nil, fmt.Errorf("%q cipher: %w", info, err)
	}
	return cipher.NewGCM(b)
}
