"""The guest image: kernel, initramfs and root filesystem built from Debian packages."""

from cryobox.image.build import Image, ensure_image, find_image, image_key

__all__ = ["Image", "ensure_image", "find_image", "image_key"]
